"""The planning core: pure data in, data out (no FastAPI, SQLAlchemy or torch).

Pipeline: :func:`parse_instance` / :func:`parse_rank` (:mod:`.parse`) check registered page tables
into :mod:`.model` data; :func:`validate_pairing` explains every incompatibility;
:func:`compile_plan` builds the rank map, elects senders and emits strided transfer templates;
:func:`expand` applies a plan to one request's block lists. Module docstrings state the formulas:
:mod:`.heads` (shards, replicas, head ranges), :mod:`.match` (view matching), :mod:`.validate`
(error codes), :mod:`.plan` (election, templates), :mod:`.expand` (block alignment by tokens, also
for different ``tokens_per_block``), :mod:`.state` (per-request recurrent state: the state axis,
SSM heads, SECTIONED conv state).
"""

from geometry.errors import GeometryError, Problem
from geometry.expand import Expansion, expand, summarize
from geometry.heads import ViewGeometry
from geometry.model import Buffer, Instance, Pool, RankTable, View
from geometry.parse import parse_instance, parse_rank
from geometry.plan import (
    Plan,
    ReceiverPlan,
    Route,
    Segment,
    active_ranks,
    compile_plan,
    validate_pairing,
)
from geometry.state import StateGeometry, view_geometry
from geometry.validate import Issue, Report

__all__ = [
    "Buffer",
    "Expansion",
    "GeometryError",
    "Instance",
    "Issue",
    "Plan",
    "Pool",
    "Problem",
    "RankTable",
    "ReceiverPlan",
    "Report",
    "Route",
    "Segment",
    "StateGeometry",
    "View",
    "ViewGeometry",
    "active_ranks",
    "compile_plan",
    "expand",
    "summarize",
    "parse_instance",
    "parse_rank",
    "validate_pairing",
    "view_geometry",
]
