"""Migrations: empty → head → base → head on SQLite and PostgreSQL; models match the tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from api.db import Base
from api.migrate import current_revisions, downgrade, head_revisions, upgrade

TABLES = {
    "instances",
    "instance_ranks",
    "pairings",
    "plans",
    "transfers",
    "workers",
    "jobs",
    "tokens",
    "dashboard_sessions",
}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    url: str = request.getfixturevalue("postgres_empty_url")
    return url


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _revisions(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return current_revisions(conn)
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    assert _tables(empty_url) == set()
    upgrade(empty_url)
    assert _tables(empty_url) == TABLES
    assert _revisions(empty_url) == head_revisions()
    downgrade(empty_url)
    assert _tables(empty_url) == set()
    assert _revisions(empty_url) == set()
    upgrade(empty_url)
    assert _tables(empty_url) == TABLES


def test_models_match_migrations(empty_url: str) -> None:
    upgrade(empty_url)
    engine = create_engine(empty_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; add a migration: {diff}"
