"""Dashboard sessions stored server-side (logout revokes them); worker tokens bound to a rank.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("token_id", sa.String(32), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        sa.Column("revoked_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dashboard_sessions")),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["tokens.id"],
            name=op.f("fk_dashboard_sessions_token_id_tokens"),
            ondelete="CASCADE",
        ),
    )
    op.create_index(
        op.f("ix_dashboard_sessions_token_id"), "dashboard_sessions", ["token_id"], unique=False
    )
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("rank", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("rank")
    op.drop_index(op.f("ix_dashboard_sessions_token_id"), table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
