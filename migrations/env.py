"""Alembic environment for sqllocker's own table.

sqllocker builds the alembic Config in code (sqllocker/migrations.py) and passes, in
``config.attributes``: ``table`` (the lock table's name), ``version_table`` (never the
application's ``alembic_version``), and either ``connection`` (online) or ``url`` (``--sql``).
"""

from alembic import context

config = context.config
version_table = config.attributes["version_table"]

if context.is_offline_mode():
    context.configure(
        url=config.attributes["url"],
        literal_binds=True,
        # As alembic's own template: printed SQL has no placeholders, so a '%' (in a function's
        # RAISE, a lockstring an adoption copies) stays one, not the '%%' of psycopg's and
        # PyMySQL's format paramstyle.
        dialect_opts={"paramstyle": "named"},
        version_table=version_table,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    context.configure(
        connection=config.attributes["connection"],
        version_table=version_table,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()
