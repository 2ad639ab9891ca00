"""Operator commands of ``kvplane`` against a running control plane (through :class:`Client`).

``kvplane instances list|show``, ``pairings list|check``, ``plan show``, ``transfers list|show``,
``workers list``. Every command takes ``--control-plane`` (env ``KVPLANE_URL``), ``--token``
(env ``KVPLANE_TOKEN``) and ``--json``; without ``--json`` it prints aligned tables. An API error
prints ``error: <code>: <detail>`` on stderr and exits 2; an unreachable control plane prints one
line naming the URL and exits 2 as well. ``kvplane worker`` shares the same two options.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from api.client import ApiError, Client, TransportError

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "KVPLANE_URL"
TOKEN_ENV = "KVPLANE_TOKEN"

ControlPlane = Annotated[
    str,
    typer.Option(
        "--control-plane",
        envvar=URL_ENV,
        show_envvar=True,
        help="Control-plane URL; several API processes: comma-separated, failed over in turn.",
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar=TOKEN_ENV,
        show_envvar=True,
        show_default=False,
        help="Bearer token, when the server runs with KVPLANE_AUTH=true (prefer the variable: "
        "ps shows options).",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the API's JSON.")]

instances_app = typer.Typer(help="Registered instances.", no_args_is_help=True)
pairings_app = typer.Typer(
    help="Pairings of a context and a generation instance.", no_args_is_help=True
)
plan_app = typer.Typer(help="Compiled transfer plans.", no_args_is_help=True)
transfers_app = typer.Typer(help="Planned and executed transfers.", no_args_is_help=True)
workers_app = typer.Typer(help="Worker processes.", no_args_is_help=True)


def install(cli: typer.Typer) -> None:
    """Add the operator sub-commands to the ``kvplane`` app."""
    cli.add_typer(instances_app, name="instances")
    cli.add_typer(pairings_app, name="pairings")
    cli.add_typer(plan_app, name="plan")
    cli.add_typer(transfers_app, name="transfers")
    cli.add_typer(workers_app, name="workers")


def unreachable(url: str, error: TransportError) -> typer.Exit:
    """Print the one-line "cannot reach" error naming ``url``; the caller raises the result."""
    typer.echo(
        f"error: cannot reach the control plane at {url} ({error.detail}); "
        f"check --control-plane or {URL_ENV}",
        err=True,
    )
    return typer.Exit(2)


def api_failure(error: ApiError) -> typer.Exit:
    """Print ``error: <code>: <detail>`` and the field errors; the caller raises the result."""
    typer.echo(f"error: {error.code}: {error.detail}", err=True)
    for field_error in error.errors:
        where = ".".join(str(part) for part in field_error.get("loc", []))
        typer.echo(f"  {where}: {field_error.get('msg', '')}", err=True)
    return typer.Exit(2)


def usage_error(message: str) -> typer.Exit:
    """Print ``error: <message>`` (a wrong argument the server cannot judge); exit 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn a database that cannot be used into one line naming it (password hidden); exit 2.

    For the commands that work on ``KVPLANE_DATABASE_URL`` directly (``migrate``, ``tokens``,
    ``serve``'s start-up migration).
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

    try:
        yield
    except (OperationalError, ProgrammingError, DBAPIError) as error:
        shown = make_url(url).render_as_string(hide_password=True)
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        if "no such table" in reason or ("relation" in reason and "does not exist" in reason):
            raise usage_error(
                f"the database at {shown} has no kvplane schema ({reason}); "
                "run `kvplane migrate` first"
            ) from None
        raise usage_error(
            f"cannot use the database at {shown} ({reason}); check KVPLANE_DATABASE_URL"
        ) from None


@contextmanager
def _client(url: str, token: str | None) -> Iterator[Client]:
    # Few, short retries: an operator at a terminal wants an answer, not a long backoff.
    try:
        with Client(url, token=token, retries=2, backoff_s=0.2, max_backoff_s=1.0) as client:
            yield client
    except TransportError as error:
        raise unreachable(url, error) from None
    except ApiError as error:
        raise api_failure(error) from None


def _nothing(kind: str, **filters: str | None) -> str:
    """``no workers``, or ``no workers with instance=x`` (an empty list, said in words)."""
    shown = ", ".join(f"{key}={value}" for key, value in filters.items() if value is not None)
    return f"no {kind}" + (f" with {shown}" if shown else "")


def _dump(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns; numbers right-aligned, everything else left-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        bool(rows)
        and all(isinstance(row[i], int | float) and not isinstance(row[i], bool) for row in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            value.rjust(width) if num else value.ljust(width)
            for value, width, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(row) for row in cells)])


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _plain(value: int | None) -> str | None:
    """An identifier-like number (a PID) printed without thousands separators."""
    return None if value is None else str(value)


def ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``0-2,5,7-8``."""
    ordered = sorted(set(values))
    parts: list[str] = []
    start = previous = None
    for value in [*ordered, None]:
        if value is not None and previous is not None and value == previous + 1:
            previous = value
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = value
    return ",".join(parts) or "-"


def _heads(span: Sequence[int] | None) -> str:
    return "all" if span is None else f"[{span[0]},{span[1]})"


# --- instances ---------------------------------------------------------------------------


@instances_app.command("list")
def instances_list(
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    role: Annotated[str | None, typer.Option(help="context or generation.")] = None,
    status: Annotated[str | None, typer.Option(help="incomplete or ready.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 1000,
) -> None:
    """List registered instances."""
    params = {k: v for k, v in (("role", role), ("status", status)) if v is not None}
    with _client(control_plane, token) as client:
        page = client.list_instances(limit=limit, **params)
    if as_json:
        _dump(page)
        return
    if not page["items"]:
        typer.echo(_nothing("instances", role=role, status=status))
        return
    rows = [
        [
            i["name"],
            i["role"],
            i["status"],
            i.get("model"),
            i["tp"],
            i["pp"],
            i["cp"],
            i["attention_dp"],
            i["tokens_per_block"],
            i["generation"],
            ranges(i["missing_ranks"]) if i["missing_ranks"] else "-",
        ]
        for i in page["items"]
    ]
    typer.echo(
        table(
            [
                "NAME",
                "ROLE",
                "STATUS",
                "MODEL",
                "TP",
                "PP",
                "CP",
                "ATTN_DP",
                "TOKENS/BLOCK",
                "GENERATION",
                "MISSING_RANKS",
            ],
            rows,
        )
    )
    if page["total"] > len(rows):
        typer.echo(f"({len(rows)} of {page['total']}; raise --limit)")


@instances_app.command("show")
def instances_show(
    name: Annotated[str, typer.Argument(help="Instance name.")],
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """One instance: parallelism, and per rank its pools and views (head geometry)."""
    with _client(control_plane, token) as client:
        inst = client.get_instance(name)
    if as_json:
        _dump(inst)
        return
    typer.echo(
        f"{inst['name']}: {inst['role']}, {inst['status']}, model {inst.get('model') or '-'}, "
        f"tp={inst['tp']} pp={inst['pp']} cp={inst['cp']} attention_dp={inst['attention_dp']}, "
        f"{inst['tokens_per_block']} tokens/block, generation {inst['generation']}, "
        f"epoch {inst['epoch'][:8]}"
    )
    if inst["missing_ranks"]:
        typer.echo(f"missing ranks: {ranges(inst['missing_ranks'])}")
    rows = []
    for rank in inst["ranks"]:
        pools = {pool["id"]: pool for pool in rank["pools"]}
        for view in rank["views"]:
            pool = pools.get(view["pool"], {})
            rows.append(
                [
                    rank["rank"],
                    view["pool"],
                    pool.get("layer_group"),
                    pool.get("num_slots"),
                    pool.get("slot_bytes"),
                    view["owner"],
                    "+".join(view["roles"]),
                    view["layout"],
                    view.get("num_kv_heads")
                    or rank.get("kv_heads_per_rank")
                    or inst.get("kv_heads_per_rank"),
                    view.get("total_kv_heads") or inst.get("total_kv_heads"),
                    view.get("head_dim"),
                    view["dtype"],
                    ranges(sorted({b["layer"] for b in view["buffers"]})),
                ]
            )
    typer.echo(
        table(
            [
                "RANK",
                "POOL",
                "GROUP",
                "SLOTS",
                "SLOT_BYTES",
                "OWNER",
                "ROLES",
                "LAYOUT",
                "KV_HEADS",
                "TOTAL_HEADS",
                "HEAD_DIM",
                "DTYPE",
                "LAYERS",
            ],
            rows,
        )
    )


# --- pairings ----------------------------------------------------------------------------


@pairings_app.command("list")
def pairings_list(
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    instance: Annotated[
        str | None, typer.Option(help="Only pairings that use this instance.")
    ] = None,
    status: Annotated[str | None, typer.Option(help="compatible, incompatible or stale.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 1000,
) -> None:
    """List stored pairings, newest first, with their errors and warnings counted."""
    params = {k: v for k, v in (("instance", instance), ("status", status)) if v is not None}
    with _client(control_plane, token) as client:
        page = client.list_pairings(limit=limit, **params)
    if as_json:
        _dump(page)
        return
    if not page["items"]:
        typer.echo(_nothing("pairings", instance=instance, status=status))
        return
    rows = [
        [
            p["id"],
            p["context"],
            p["generation"],
            p["status"],
            len(p["errors"]),
            len(p["warnings"]),
            str(p["validated_at"])[:19].replace("T", " "),
        ]
        for p in page["items"]
    ]
    typer.echo(
        table(["ID", "CONTEXT", "GENERATION", "STATUS", "ERRORS", "WARNINGS", "VALIDATED"], rows)
    )
    if page["total"] > len(rows):
        typer.echo(f"({len(rows)} of {page['total']}; raise --limit)")


@pairings_app.command("check")
def pairings_check(
    context: Annotated[str, typer.Argument(help="Context instance name.")],
    generation: Annotated[str, typer.Argument(help="Generation instance name.")],
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create or re-validate the pairing and print its report: exit 0 compatible, 1 not."""
    with _client(control_plane, token) as client:
        pairing = client.create_pairing(context, generation)
    if as_json:
        _dump(pairing)
    else:
        verdict = "compatible" if pairing["compatible"] else "INCOMPATIBLE"
        typer.echo(f"{context} -> {generation}: {verdict} (pairing {pairing['id']})")
        rows = [
            [kind[:-1], issue["code"], issue["message"]]
            for kind in ("errors", "warnings")
            for issue in pairing[kind]
        ]
        if rows:
            typer.echo(table(["KIND", "CODE", "MESSAGE"], rows))
    raise typer.Exit(0 if pairing["compatible"] else 1)


def world_size(instance: dict[str, Any]) -> int:
    """Ranks of a registered instance: ``tp × pp × cp``."""
    return int(instance["tp"]) * int(instance["pp"]) * int(instance["cp"])


def check_rank(instance: dict[str, Any], rank: int, *, option: str) -> None:
    """Exit 2 naming the valid range when ``rank`` is not a rank of ``instance``."""
    size = world_size(instance)
    if not 0 <= rank < size:
        raise usage_error(
            f"{option} {rank} is out of range: {instance['name']} has ranks 0-{size - 1} "
            f"(tp={instance['tp']} pp={instance['pp']} cp={instance['cp']})"
            if size > 1
            else f"{option} {rank} is out of range: {instance['name']} has only rank 0"
        )


def _find_pairing(client: Client, context: str, generation: str) -> dict[str, Any]:
    offset = 0
    while True:
        page = client.list_pairings(instance=context, limit=1000, offset=offset)
        for item in page["items"]:
            if item["context"] == context and item["generation"] == generation:
                return dict(item)
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            raise ApiError(
                404,
                "pairing_not_found",
                f"no pairing of {context!r} with {generation!r}; "
                f"run: kvplane pairings check {context} {generation}",
            )


# --- plan --------------------------------------------------------------------------------


@plan_app.command("show")
def plan_show(
    context: Annotated[str, typer.Argument(help="Context instance name.")],
    generation: Annotated[str, typer.Argument(help="Generation instance name.")],
    receiver_rank: Annotated[int, typer.Option(min=0, help="The generation rank to explain.")],
    context_dp_rank: Annotated[int | None, typer.Option(min=0)] = None,
    generation_dp_rank: Annotated[int | None, typer.Option(min=0)] = None,
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Which sender rank fills which head range of each view on one receiver rank."""
    with _client(control_plane, token) as client:
        pairing = _find_pairing(client, context, generation)
        check_rank(client.get_instance(generation), receiver_rank, option="--receiver-rank")
        plan = client.get_plan(
            pairing["id"], context_dp_rank=context_dp_rank, generation_dp_rank=generation_dp_rank
        )
    routes = [r for r in plan["routes"] if r["receiver_rank"] == receiver_rank]
    entries = sorted(
        (
            {"sender_rank": route["sender_rank"], **piece}
            for route in routes
            for piece in route.get("slices", [])
        ),
        key=lambda e: (
            e["receiver_view"],
            e["layers"][:1],
            (e["receiver_local_heads"] or [0])[0],
            e["sender_rank"],
        ),
    )
    receiver = next((r for r in plan["receivers"] if r["rank"] == receiver_rank), None)
    if as_json:
        _dump(
            {
                "pairing_id": pairing["id"],
                "receiver_rank": receiver_rank,
                "receiver": receiver,
                "slices": entries,
            }
        )
        return
    writers = receiver["writers"] if receiver else 0
    typer.echo(
        f"{context} -> {generation} receiver rank {receiver_rank}: {writers} writer(s), "
        f"{sum(r['bytes_per_block'] for r in routes):,} bytes per block"
        + ("" if receiver is None else f", equal-split safe: {receiver['equal_split_safe']}")
    )
    if not entries:
        typer.echo("nothing is sent to this rank in this plan")
        return
    rows = [
        [
            e["receiver_view"],
            e["owner"],
            "+".join(e["roles"]),
            e["layout"],
            ranges(e["layers"]),
            _heads(e["receiver_local_heads"]),
            _heads(e["global_heads"]),
            e["sender_rank"],
            e["sender_view"],
            _heads(e["sender_local_heads"]),
            e["bytes_per_block"],
        ]
        for e in entries
    ]
    typer.echo(
        table(
            [
                "VIEW",
                "OWNER",
                "ROLES",
                "LAYOUT",
                "LAYERS",
                "RECV_HEADS",
                "GLOBAL_HEADS",
                "SENDER",
                "SENDER_VIEW",
                "SENDER_HEADS",
                "BYTES/BLOCK",
            ],
            rows,
        )
    )
    for warning in plan.get("warnings", []):
        text = warning.get("message", warning) if isinstance(warning, dict) else warning
        typer.echo(f"warning: {text}")


# --- transfers ---------------------------------------------------------------------------


@transfers_app.command("list")
def transfers_list(
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    status: Annotated[
        str | None, typer.Option(help="planned, queued, running, done or failed.")
    ] = None,
    context: Annotated[str | None, typer.Option(help="Context instance.")] = None,
    generation: Annotated[str | None, typer.Option(help="Generation instance.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
) -> None:
    """List transfers, newest first."""
    params = {
        k: v
        for k, v in (("status", status), ("context", context), ("generation", generation))
        if v is not None
    }
    with _client(control_plane, token) as client:
        page = client.list_transfers(limit=limit, **params)
    if as_json:
        _dump(page)
        return
    if not page["items"]:
        typer.echo(_nothing("transfers", status=status, context=context, generation=generation))
        return
    rows = [
        [
            t["id"],
            t["status"],
            t["context"],
            t["generation"],
            t["request_id"],
            t["bytes"],
            t["fragments"],
            t["attempt"],
            t["duration_s"],
            t["created_at"][:19],
        ]
        for t in page["items"]
    ]
    typer.echo(
        table(
            [
                "ID",
                "STATUS",
                "CONTEXT",
                "GENERATION",
                "REQUEST",
                "BYTES",
                "FRAGMENTS",
                "ATTEMPT",
                "DURATION_S",
                "CREATED",
            ],
            rows,
        )
    )
    if page["total"] > len(rows):
        typer.echo(f"({len(rows)} of {page['total']}; raise --limit)")


@transfers_app.command("show")
def transfers_show(
    transfer_id: Annotated[str, typer.Argument(help="Transfer id.")],
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """One transfer: status, routes and each rank's recorded part."""
    with _client(control_plane, token) as client:
        transfer = client.get_transfer(transfer_id)
        jobs = client.list_parts(transfer_id)["items"] if transfer["execute"] else []
    if as_json:
        _dump({**transfer, "parts": jobs})
        return
    typer.echo(
        f"transfer {transfer['id']}: {transfer['status']}, {transfer['context']} -> "
        f"{transfer['generation']}, request {transfer['request_id']}, "
        f"{transfer['bytes']:,} bytes, {transfer['fragments']:,} fragments, "
        f"mode {transfer['mode']}, attempt {transfer['attempt']}"
    )
    if transfer.get("error"):
        typer.echo(f"error: {transfer['error']}")
    typer.echo(
        table(
            ["SENDER", "RECEIVER", "BYTES", "FRAGMENTS"],
            [
                [r["sender_rank"], r["receiver_rank"], r["bytes"], r["fragments"]]
                for r in transfer["routes"]
            ],
        )
    )
    if jobs:
        typer.echo("")
        typer.echo(
            table(
                ["PART", "SIDE", "INSTANCE", "RANK", "STATE", "ATTEMPT", "WORKER", "ERROR"],
                [
                    [
                        j["id"],
                        j["kind"],
                        j["instance"],
                        j["rank"],
                        j["state"],
                        j["attempt"],
                        j["worker_id"],
                        (j.get("error") or "")[:60],
                    ]
                    for j in jobs
                ],
            )
        )


# --- workers -----------------------------------------------------------------------------


@workers_app.command("list")
def workers_list(
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    instance: Annotated[str | None, typer.Option(help="Only this instance's workers.")] = None,
) -> None:
    """Workers with their status and whether their command stream is connected."""
    params: dict[str, Any] = {} if instance is None else {"instance": instance}
    with _client(control_plane, token) as client:
        page = client.list_workers(**params)
        if instance is not None and not page["items"]:
            client.get_instance(instance)  # a misspelt name is an error, not "no workers"
    if as_json:
        _dump(page)
        return
    if not page["items"]:
        typer.echo(_nothing("workers", instance=instance))
        return
    rows = [
        [
            w["id"],
            w["instance"],
            w["rank"],
            w["status"],
            w["device"],
            w["host"],
            _plain(w["pid"]),
            w["heartbeat_age_s"],
            "yes" if w.get("connected") else "no",
        ]
        for w in page["items"]
    ]
    typer.echo(
        table(
            [
                "ID",
                "INSTANCE",
                "RANK",
                "STATUS",
                "DEVICE",
                "HOST",
                "PID",
                "HEARTBEAT_AGE_S",
                "STREAM",
            ],
            rows,
        )
    )
