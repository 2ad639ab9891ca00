"""Initial schema: instances, ranks, pairings, cached plans, transfers.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "instances",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.String(32), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("header", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instances")),
        sa.UniqueConstraint("name", name=op.f("uq_instances_name")),
    )
    op.create_index(op.f("ix_instances_role"), "instances", ["role"])
    op.create_index(op.f("ix_instances_status"), "instances", ["status"])

    op.create_table(
        "instance_ranks",
        sa.Column("instance_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["instance_id"],
            ["instances.id"],
            name=op.f("fk_instance_ranks_instance_id_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("instance_id", "rank", name=op.f("pk_instance_ranks")),
    )

    op.create_table(
        "pairings",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("context_id", sa.Integer(), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("context_epoch", sa.String(32), nullable=False),
        sa.Column("generation_epoch", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("compatible", sa.Boolean(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("validated_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["context_id"],
            ["instances.id"],
            name=op.f("fk_pairings_context_id_instances"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["generation_id"],
            ["instances.id"],
            name=op.f("fk_pairings_generation_id_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pairings")),
        sa.UniqueConstraint("context_id", "generation_id", name=op.f("uq_pairings_context_id")),
    )
    op.create_index(op.f("ix_pairings_context_id"), "pairings", ["context_id"])
    op.create_index(op.f("ix_pairings_generation_id"), "pairings", ["generation_id"])
    op.create_index(op.f("ix_pairings_status"), "pairings", ["status"])

    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("pairing_id", sa.String(32), nullable=False),
        sa.Column("context_epoch", sa.String(32), nullable=False),
        sa.Column("generation_epoch", sa.String(32), nullable=False),
        sa.Column("context_dp_rank", sa.Integer(), nullable=False),
        sa.Column("generation_dp_rank", sa.Integer(), nullable=False),
        sa.Column("stale", sa.Boolean(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["pairing_id"],
            ["pairings.id"],
            name=op.f("fk_plans_pairing_id_pairings"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plans")),
        sa.UniqueConstraint(
            "pairing_id",
            "context_epoch",
            "generation_epoch",
            "context_dp_rank",
            "generation_dp_rank",
            name=op.f("uq_plans_pairing_id"),
        ),
    )
    op.create_index(op.f("ix_plans_pairing_id"), "plans", ["pairing_id"])

    op.create_table(
        "transfers",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("pairing_id", sa.String(32), nullable=True),
        sa.Column("plan_id", sa.Integer(), nullable=True),
        sa.Column("context_name", sa.String(128), nullable=False),
        sa.Column("generation_name", sa.String(128), nullable=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("context_dp_rank", sa.Integer(), nullable=True),
        sa.Column("generation_dp_rank", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("execute", sa.Boolean(), nullable=False),
        sa.Column("blocks", sa.JSON(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("fragments", sa.BigInteger(), nullable=False),
        sa.Column("idempotency_key", sa.String(256), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["pairing_id"],
            ["pairings.id"],
            name=op.f("fk_transfers_pairing_id_pairings"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["plan_id"],
            ["plans.id"],
            name=op.f("fk_transfers_plan_id_plans"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transfers")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_transfers_idempotency_key")),
    )
    op.create_index(op.f("ix_transfers_pairing_id"), "transfers", ["pairing_id"])
    op.create_index(op.f("ix_transfers_request_id"), "transfers", ["request_id"])
    op.create_index(op.f("ix_transfers_status"), "transfers", ["status"])


def downgrade() -> None:
    op.drop_table("transfers")
    op.drop_table("plans")
    op.drop_table("pairings")
    op.drop_table("instance_ranks")
    op.drop_table("instances")
