"""Workers: which worker superseded one on its rank; instances: a kept directory revision.

``workers.superseded_by``: a second worker attaching to an occupied rank supersedes the first,
which is told (409 ``worker_superseded`` on its heartbeat, a last line on its command stream)
and stops. ``instances.directory_revision``: a counter bumped by every change that the
directories of the instance's workers depend on, so that a heartbeat reads it instead of
recomputing a digest over every pairing.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("superseded_by", sa.String(32), nullable=True))
    with op.batch_alter_table("instances") as batch:
        batch.add_column(
            sa.Column("directory_revision", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("directory_revision")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("superseded_by")
