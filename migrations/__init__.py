"""Alembic migrations (one tree for SQLite and PostgreSQL); run them with ``kvplane migrate``."""
