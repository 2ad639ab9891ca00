"""Run Alembic from code: ``upgrade``/``downgrade`` a database and compare it with the head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect, text

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
#: Alembic's default version table (``migrations/env.py`` does not rename it).
VERSION_TABLE = "alembic_version"


def alembic_config(database_url: str) -> Config:
    """An Alembic config for ``database_url`` that needs no ini file."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Upgrade ``database_url`` to ``revision`` (default: the newest schema)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Downgrade ``database_url`` to ``revision`` (default: empty)."""
    command.downgrade(alembic_config(database_url), revision)


def head_revisions() -> set[str]:
    """The head revision ids of the migration tree."""
    return set(ScriptDirectory(str(MIGRATIONS_DIR)).get_heads())


def current_revisions(connection: Connection) -> set[str]:
    """The revision ids the connected database is at (empty when never migrated).

    Reads Alembic's version table directly: ``/readyz`` calls this on every probe, and a
    ``MigrationContext`` would log two INFO lines each time.
    """
    if not inspect(connection).has_table(VERSION_TABLE):
        return set()
    rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
    return {str(rev) for rev in rows}
