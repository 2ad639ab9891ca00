"""Fast path: transfers get a deadline; the jobs table now records each rank's part.

The per-request job queue is gone (workers run transfers from cached plans and report finished
parts in batches). ``jobs`` keeps one row per rank of an executed transfer, as its worker
recorded it; its lease and staging columns stay (nullable or defaulted) but are unused.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("transfers") as batch:
        batch.add_column(sa.Column("deadline_at", _TS, nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.create_index("ix_jobs_transfer_attempt", ["transfer_id", "attempt"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_transfer_attempt")
    with op.batch_alter_table("transfers") as batch:
        batch.drop_column("deadline_at")
