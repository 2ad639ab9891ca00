"""Execution: workers, jobs, and transfer outcome columns.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("transfers") as batch:
        batch.add_column(sa.Column("mode", sa.String(16), nullable=False, server_default="staged"))
        batch.add_column(
            sa.Column("verify", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("max_attempts", sa.Integer(), nullable=False, server_default="3")
        )
        batch.add_column(sa.Column("error", sa.String(2000), nullable=True))
        batch.add_column(sa.Column("started_at", _TS, nullable=True))
        batch.add_column(sa.Column("finished_at", _TS, nullable=True))
        batch.create_index("ix_transfers_created_at", ["created_at"])

    op.create_table(
        "workers",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("instance_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.String(32), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("transport", sa.String(16), nullable=False),
        sa.Column("agent", sa.String(256), nullable=False),
        sa.Column("peer", sa.JSON(), nullable=False),
        sa.Column("host", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("stopped", sa.Boolean(), nullable=False),
        sa.Column("registered_at", _TS, nullable=False),
        sa.Column("heartbeat_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["instance_id"],
            ["instances.id"],
            ondelete="CASCADE",
            name=op.f("fk_workers_instance_id_instances"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_instance_id"), "workers", ["instance_id"])
    op.create_index(op.f("ix_workers_heartbeat_at"), "workers", ["heartbeat_at"])
    op.create_index("ix_workers_instance_rank", "workers", ["instance_id", "rank"])

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("transfer_id", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("instance_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("claims", sa.Integer(), nullable=False),
        sa.Column("lease_token", sa.String(32), nullable=True),
        sa.Column("lease_expires_at", _TS, nullable=True),
        sa.Column("worker_id", sa.String(32), nullable=True),
        sa.Column("not_before", _TS, nullable=False),
        sa.Column("staging_offset", sa.BigInteger(), nullable=False),
        sa.Column("staging_bytes", sa.BigInteger(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.String(2000), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["transfer_id"],
            ["transfers.id"],
            ondelete="CASCADE",
            name=op.f("fk_jobs_transfer_id_transfers"),
        ),
        sa.ForeignKeyConstraint(
            ["instance_id"],
            ["instances.id"],
            ondelete="CASCADE",
            name=op.f("fk_jobs_instance_id_instances"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_transfer_id"), "jobs", ["transfer_id"])
    op.create_index(op.f("ix_jobs_state"), "jobs", ["state"])
    op.create_index("ix_jobs_claim", "jobs", ["instance_id", "rank", "state", "not_before"])


def downgrade() -> None:
    op.drop_index("ix_jobs_claim", table_name="jobs")
    op.drop_index(op.f("ix_jobs_state"), table_name="jobs")
    op.drop_index(op.f("ix_jobs_transfer_id"), table_name="jobs")
    op.drop_table("jobs")
    op.drop_index("ix_workers_instance_rank", table_name="workers")
    op.drop_index(op.f("ix_workers_heartbeat_at"), table_name="workers")
    op.drop_index(op.f("ix_workers_instance_id"), table_name="workers")
    op.drop_table("workers")
    with op.batch_alter_table("transfers") as batch:
        batch.drop_index("ix_transfers_created_at")
        for column in (
            "finished_at",
            "started_at",
            "error",
            "max_attempts",
            "attempt",
            "verify",
            "mode",
        ):
            batch.drop_column(column)
