"""PostgreSQL: DBIx::Locker's rows have their times read again as UTC.

A row DBIx::Locker writes (its guid is the column's default) carries its times as local text
without an offset, which the inserting session read in its own TimeZone: up to 26 hours off
the truth (Perl at UTC-12, the session at UTC+14), past the 14 hours such rows are given
(``schema.FOREIGN_CLOCK_MARGIN``), so that they could be taken over while Perl still held them.
``<table>_foreign_times``, a trigger on inserts and on updates of the times, reads that text
again as UTC, as MySQL and SQLite store it: the times are then off by Perl's own offset only,
which the margin covers. Nothing on MySQL/MariaDB and SQLite.

Rows already in the table keep their times: what zone their session read them in is not known.
An adoption (``sqllocker.adoption``) runs this after its rows are copied, in UTC already.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

from alembic import context, op

from sqllocker.migration_functions import backend_name, create_pinned_functions, drop_functions
from sqllocker.schema import FOREIGN_GUID_PREFIX
from sqllocker.validation import check_table_name

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION_SIGNATURES = ("{table}_foreign_times()",)


def _foreign_times(table: str) -> str:
    # The cast to timestamp gives back the text as the session read it. SECURITY INVOKER: it
    # only rewrites the row it is given. Never OR REPLACE: a function of that name that another
    # role made would keep its owner, who could rewrite what the trigger runs.
    return f"""
        CREATE FUNCTION {table}_foreign_times() RETURNS trigger
        LANGUAGE plpgsql SECURITY INVOKER AS $$
        BEGIN
            IF TG_OP OPERATOR(pg_catalog.=) 'INSERT'::text THEN
                NEW.created := pg_catalog.timezone('UTC'::text, NEW.created::timestamp);
                NEW.expires := pg_catalog.timezone('UTC'::text, NEW.expires::timestamp);
                RETURN NEW;
            END IF;
            IF NEW.created IS DISTINCT FROM OLD.created THEN
                NEW.created := pg_catalog.timezone('UTC'::text, NEW.created::timestamp);
            END IF;
            IF NEW.expires IS DISTINCT FROM OLD.expires THEN
                NEW.expires := pg_catalog.timezone('UTC'::text, NEW.expires::timestamp);
            END IF;
            RETURN NEW;
        END
        $$"""


def create(table: str) -> None:
    """The trigger and its function; also what 0004 goes back to."""
    create_pinned_functions(table, [_foreign_times(table)], _FUNCTION_SIGNATURES)
    op.execute(
        f"CREATE TRIGGER {table}_foreign_times BEFORE INSERT OR UPDATE OF created, expires "
        f"ON {table} FOR EACH ROW WHEN (pg_catalog.starts_with(NEW.guid::text, "
        f"'{FOREIGN_GUID_PREFIX}'::text)) EXECUTE FUNCTION {table}_foreign_times()"
    )


def drop(table: str) -> None:
    op.execute(f"DROP TRIGGER {table}_foreign_times ON {table}")
    drop_functions(table, _FUNCTION_SIGNATURES)


def upgrade() -> None:
    if backend_name() != "postgresql":
        return
    create(check_table_name(context.config.attributes["table"]))


def downgrade() -> None:
    if backend_name() != "postgresql":
        return
    drop(check_table_name(context.config.attributes["table"]))
