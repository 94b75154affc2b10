"""How sqllocker's migrations make their PostgreSQL functions safe to call from any path.

Every function is made in the lock table's own schema, then has its ``search_path`` pinned to
``pg_catalog``, that schema and ``pg_temp`` (last), so that nothing another role creates in a
schema on a caller's path can run in its place (CVE-2018-1058); PUBLIC gets no EXECUTE on it.
All of it is SQL, so that ``sqllocker migrate --sql`` prints it for a DBA too. Shared by the
revisions in ``migrations/versions``: each passes the functions it makes and their signatures.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from .backends import backend_class


def backend_name() -> str:
    """The migrating connection's backend: ``postgresql``, ``mysql`` (MariaDB's dialect too,
    which SQLAlchemy names ``mariadb``) or ``sqlite``."""
    return backend_class(op.get_context().dialect.name).name


def create_pinned_functions(
    table: str, functions: Sequence[str], signatures: Sequence[str]
) -> None:
    """Run the ``CREATE FUNCTION`` statements ``functions`` beside ``table``, pin the path of
    each function in ``signatures`` (``{table}`` stands for the table's name), and revoke
    EXECUTE on them from PUBLIC."""
    resolved = [signature.format(table=table) for signature in signatures]
    # While the functions are made, the transaction's search_path is the table's schema, so
    # that they are made beside it.
    op.execute(
        "SELECT pg_catalog.set_config('sqllocker.saved_search_path', "
        "pg_catalog.current_setting('search_path'), true), "
        "pg_catalog.set_config('sqllocker.schema', "
        "pg_catalog.quote_ident(pg_catalog.current_schema()), true)"
    )
    op.execute(
        "SELECT pg_catalog.set_config('search_path', "
        "pg_catalog.current_setting('sqllocker.schema'), true)"
    )
    for function in functions:
        op.execute(function)
    op.execute(
        "SELECT pg_catalog.set_config('search_path', 'pg_catalog, ' "
        "OPERATOR(pg_catalog.||) pg_catalog.current_setting('sqllocker.schema') "
        "OPERATOR(pg_catalog.||) ', pg_temp', true)"
    )
    for function in resolved:
        op.execute(f"ALTER FUNCTION {function} SET search_path FROM CURRENT")
    op.execute(
        "SELECT pg_catalog.set_config('search_path', "
        "pg_catalog.current_setting('sqllocker.saved_search_path'), true)"
    )
    for function in resolved:
        op.execute(f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC")


def drop_functions(table: str, signatures: Sequence[str]) -> None:
    """Drop the functions ``signatures`` name (``{table}`` stands for the table's name)."""
    for signature in signatures:
        op.execute(f"DROP FUNCTION {signature.format(table=table)}")


def carry_execute_grants(table: str, old_signature: str, new_signature: str) -> None:
    """Grant EXECUTE on the function ``new_signature`` to every role that has it on
    ``old_signature`` (but PUBLIC and the owner), with the grant option where it had it: a
    function whose arguments change is a new function, and one dropped takes its grants along.
    ``{table}`` stands for the table's name in both."""
    old = old_signature.format(table=table)
    new = new_signature.format(table=table)
    # The signatures are the migrations' own, written out as dollar-quoted literals; the
    # grantees' names are quoted by format's %I.
    op.execute(
        f"""
        DO $$
        DECLARE
            granted record;
        BEGIN
            FOR granted IN
                SELECT r.rolname, a.is_grantable
                  FROM pg_catalog.pg_proc AS p,
                       LATERAL pg_catalog.aclexplode(p.proacl) AS a
                  JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) a.grantee
                 WHERE p.oid OPERATOR(pg_catalog.=) $sig${old}$sig$::pg_catalog.regprocedure
                   AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'::text
                   AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
            LOOP
                EXECUTE pg_catalog.format(
                    'GRANT EXECUTE ON FUNCTION %s TO %I%s', $sig${new}$sig$, granted.rolname,
                    CASE WHEN granted.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
            END LOOP;
        END
        $$"""  # noqa: S608
    )
