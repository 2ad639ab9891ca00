"""The ``kvplane`` root command: serve, migrate, check, describe, worker, demo, and the
operator and token families (:mod:`cli.ops`, :mod:`cli.tokens`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from cli.ops import (
    DEFAULT_URL,
    ControlPlane,
    Token,
    api_failure,
    check_rank,
    database_errors,
    unreachable,
    usage_error,
)

cli = typer.Typer(
    help="kvplane: control plane for disaggregated LLM serving.", no_args_is_help=True
)


@cli.command()
def serve(
    host: str = typer.Option(
        "127.0.0.1", envvar="KVPLANE_HOST", show_envvar=True, help="Address to bind."
    ),
    port: int = typer.Option(8000, envvar="KVPLANE_PORT", show_envvar=True, help="Port to bind."),
    demo_fleet: bool = typer.Option(
        False,
        "--demo-fleet",
        envvar="KVPLANE_DEMO_FLEET",
        show_envvar=True,
        help="Register a small demo fleet.",
    ),
    migrate: bool = typer.Option(
        True, "--migrate/--no-migrate", help="Upgrade the database to the newest schema first."
    ),
    insecure: bool = typer.Option(
        False, "--insecure", help="Allow a non-loopback --host without KVPLANE_AUTH=true."
    ),
) -> None:
    """Run the control-plane HTTP server (API docs at /docs)."""
    import uvicorn

    from api.app import create_app
    from api.logs import configure_logging
    from api.settings import Settings

    settings = Settings(host=host, port=port, demo_fleet=demo_fleet, migrate_on_startup=migrate)
    configure_logging(json_lines=settings.log_json)
    _refuse_exposure(host, auth=settings.auth, insecure=insecure)
    typer.echo(
        f"kvplane on http://{host}:{port} (API docs: /docs), database {settings.database_url}"
    )
    with database_errors(settings.database_url):
        app = create_app(settings)
    # Our handler formats uvicorn's records too; access lines come from RequestIdMiddleware.
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False)


def _refuse_exposure(host: str, *, auth: bool, insecure: bool) -> None:
    """Exit 2 on a non-loopback host without auth; with --insecure, warn (at every start)."""
    import logging

    from api.auth import exposure_refusal

    refusal = exposure_refusal(host, auth=auth)
    if refusal and not insecure:
        typer.echo(f"error: {refusal}", err=True)
        raise typer.Exit(2)
    if refusal:
        logging.getLogger("kvplane.serve").warning(
            "INSECURE: serving on %s without authentication (--insecure)", host
        )


@cli.command()
def migrate() -> None:
    """Upgrade the database (KVPLANE_DATABASE_URL, default SQLite file) to the newest schema."""
    from api.migrate import upgrade
    from api.settings import Settings

    settings = Settings()
    with database_errors(settings.database_url):
        upgrade(settings.database_url)
    typer.echo(f"migrated {settings.database_url} to head")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        typer.echo(f"error: cannot read {path}: {error}", err=True)
        raise typer.Exit(2) from None


@cli.command()
def check(
    context_file: Path = typer.Argument(..., help="Context instance body (JSON)."),
    generation_file: Path = typer.Argument(..., help="Generation instance body (JSON)."),
    context_dp_rank: int | None = typer.Option(None, help="Only this context DP rank."),
    generation_dp_rank: int | None = typer.Option(None, help="Only this generation DP rank."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
) -> None:
    """Validate a planned pairing offline (no server): exit 0 compatible, 1 not, 2 bad input."""
    from cli.check import check_bodies, explain
    from geometry import GeometryError

    context_body = _load_json(context_file)
    generation_body = _load_json(generation_file)
    try:
        result = check_bodies(
            context_body,
            generation_body,
            context_name=context_file.stem,
            generation_name=generation_file.stem,
            context_dp_rank=context_dp_rank,
            generation_dp_rank=generation_dp_rank,
        )
    except GeometryError as error:
        if as_json:
            typer.echo(json.dumps({"errors": [p.to_dict() for p in error.problems]}, indent=2))
        else:
            for problem in error.problems:
                where = ".".join(str(part) for part in problem.loc)
                typer.echo(f"invalid: {where}: {problem.message}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        verdict = "compatible" if result["compatible"] else "INCOMPATIBLE"
        typer.echo(f"{context_file.stem} -> {generation_file.stem}: {verdict}")
        for kind in ("errors", "warnings"):
            for issue in result[kind]:
                typer.echo(f"  {kind[:-1]:<7} {issue['code']:<28} {issue['message']}")
                why = explain(issue["code"])
                if why:
                    typer.echo(f"  {'':<7} {'':<28} why: {why}")
        for plan in result["plans"]:
            per_block = "block"
            if plan["large_side"]:
                small_side = "context" if plan["large_side"] == "generation" else "generation"
                per_block = (
                    f"{plan['large_side']} block ({plan['block_ratio']} {small_side} blocks)"
                )
            typer.echo(
                f"  plan dp=({plan['context_dp_rank']},{plan['generation_dp_rank']}): "
                f"{plan['routes']} routes, {plan['runs']} runs, "
                f"{plan['bytes_per_block']:,} bytes per {per_block}"
            )
            for receiver in plan["receivers"]:
                if len(receiver["writers"]) > 1:
                    typer.echo(
                        f"    generation rank {receiver['rank']} <- context ranks "
                        f"{receiver['writers']}"
                        + ("" if receiver["equal_split_safe"] else " (writers carry unequal bytes)")
                    )
    raise typer.Exit(0 if result["compatible"] else 1)


@cli.command()
def describe(
    config: Path = typer.Argument(..., help="Hugging Face style config.json of the model."),
    role: str = typer.Option(..., help="context or generation."),
    tp: int = typer.Option(1, min=1),
    pp: int = typer.Option(1, min=1),
    cp: int = typer.Option(1, min=1),
    attention_dp: bool = typer.Option(False, "--attention-dp"),
    tokens_per_block: int = typer.Option(32, min=1),
    layout: str = typer.Option("HND", help="HND or NHD (MLA configs are always REPLICATED)."),
    dtype: str | None = typer.Option(None, help="KV-cache dtype (default: the config's)."),
    num_slots: int = typer.Option(1024, min=1, help="Slots per pool."),
    draft: Path | None = typer.Option(None, help="config.json of a speculative draft model."),
    output: Path | None = typer.Option(None, "--out", help="Write the body here, not stdout."),
    ssm_dtype: str | None = typer.Option(
        None, help="Hybrid models: SSM-state dtype (default: the config's, else the model's)."
    ),
    state_slots: int | None = typer.Option(
        None, min=1, help="Hybrid models: state slots (concurrent requests; default num-slots)."
    ),
) -> None:
    """Build a registration body from a model config and a parallelism (hybrid Mamba/attention
    configs add a per-request state group)."""
    from cli.describe import ConfigError
    from cli.describe import describe as build

    if layout not in ("HND", "NHD"):
        typer.echo("error: --layout must be HND or NHD", err=True)
        raise typer.Exit(2)
    try:
        body = build(
            _load_json(config),
            role=role,
            tp=tp,
            pp=pp,
            cp=cp,
            attention_dp=attention_dp,
            tokens_per_block=tokens_per_block,
            layout=layout,
            dtype=dtype,
            num_slots=num_slots,
            draft_config=_load_json(draft) if draft else None,
            ssm_dtype=ssm_dtype,
            state_slots=state_slots,
        )
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    text = json.dumps(body, indent=2)
    if output:
        output.write_text(text + "\n")
    else:
        typer.echo(text)


@cli.command()
def worker(
    instance: str = typer.Option(..., help="Instance name (registered)."),
    rank: int = typer.Option(..., min=0, help="The rank this worker serves."),
    control_plane: ControlPlane = DEFAULT_URL,
    token: Token = None,
    device: str = typer.Option("cpu", help="cpu or cuda:N: where the pools live."),
    staging_mib: int = typer.Option(256, min=1, help="Staging buffer size (MiB)."),
    fill_pattern: bool = typer.Option(
        False,
        "--fill-pattern",
        help="Fill pools with the (rank, pool, byte) test pattern and "
        "verify, after each verified transfer, the bytes it wrote and every byte no transfer "
        "targeted (demos and tests).",
    ),
    idle_exit_s: float | None = typer.Option(
        None, min=0.1, help="Exit after this many seconds without a transfer."
    ),
    metrics_port: int | None = typer.Option(
        None, min=1, max=65535, help="Serve this worker's Prometheus metrics on this port."
    ),
    ucx_tls: str | None = typer.Option(
        None,
        help="UCX transports for worker-to-worker bytes (UCX_TLS), e.g. `tcp` so that "
        "workers of one machine use its network instead of shared memory; default: the "
        "process's UCX_TLS, else every transport UCX finds. Shown in GET /v1/workers.",
    ),
    ucx_net_devices: str | None = typer.Option(
        None,
        help="Network devices UCX may use (UCX_NET_DEVICES), e.g. `eth0` or "
        "`mlx5_0:1`; default: the process's UCX_NET_DEVICES, else every device.",
    ),
) -> None:
    """Serve one rank: allocate its pools, attach over NIXL, run the transfers that REST
    pushes to it (engines embed `workers.agent.Worker` instead) until stopped."""
    import signal

    from api.client import ApiError, Client, TransportError
    from api.logs import configure_logging, set_process_context
    from api.settings import Settings
    from workers import metrics as worker_metrics
    from workers.agent import Worker, WorkerError

    configure_logging(json_lines=Settings().log_json)
    try:
        with Client(control_plane, token=token) as client:
            # Refuse a rank the instance does not have before allocating anything.
            check_rank(client.get_instance(instance), rank, option="--rank")
            agent = Worker(
                client,
                instance,
                rank,
                device=device,
                staging_bytes=staging_mib << 20,
                fill=fill_pattern,
                ucx_tls=ucx_tls,
                ucx_net_devices=ucx_net_devices,
            )
            worker_metrics.instrument(agent)
            if metrics_port is not None:
                from prometheus_client import start_http_server

                start_http_server(metrics_port)
            signal.signal(signal.SIGTERM, lambda *_: agent._stop.set())
            try:
                agent.attach()
                set_process_context(worker_id=agent.worker_id)
                worker_metrics.describe_worker(agent)
                ucx = agent.transport.ucx if agent.transport is not None else None
                typer.echo(
                    f"worker {agent.worker_id}: {instance} rank {rank} on {device}"
                    + (f" (UCX tls={ucx.tls}, devices={ucx.net_devices})" if ucx else "")
                )
                agent.serve(idle_exit_s=idle_exit_s)
            except KeyboardInterrupt:
                pass
            finally:
                agent.stop()
    except TransportError as error:
        raise unreachable(control_plane, error) from None
    except ApiError as error:
        raise api_failure(error) from None
    except WorkerError as error:  # e.g. the rank has not reported its page table yet
        raise usage_error(str(error)) from None


@cli.command()
def demo(
    blocks: int = typer.Option(64, min=1, max=4096, help="Blocks to transfer."),
    host: str = typer.Option("127.0.0.1", help="Address of the demo's own control plane."),
    port: int = typer.Option(8765, help="Port of the demo's own control plane."),
    database: Path = typer.Option(Path("var/demo.db"), help="SQLite file (recreated)."),
    keep_running: bool = typer.Option(False, help="Leave server and workers up afterwards."),
) -> None:
    """The main job: control plane + 6 real workers, a verified NIXL transfer TP4 → TP2."""
    from cli.demo import run_demo

    raise typer.Exit(
        run_demo(blocks=blocks, host=host, port=port, database=database, keep_running=keep_running)
    )


def _install_operator_commands() -> None:
    from cli.ops import install

    install(cli)


_install_operator_commands()


from cli.tokens import tokens_app  # noqa: E402

cli.add_typer(tokens_app, name="tokens")


def main() -> None:
    """The ``kvplane`` console script."""
    cli()
