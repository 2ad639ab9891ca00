"""Run Alembic from code: ``upgrade``/``downgrade`` a database and compare it with the head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


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
    """The revision ids the connected database is at (empty when never migrated)."""
    return set(MigrationContext.configure(connection).get_current_heads())
