"""The ``kvplane`` command line."""

from __future__ import annotations

import typer

cli = typer.Typer(help="kvplane: control plane for disaggregated LLM serving.", no_args_is_help=True)


@cli.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, help="Port to bind."),
    demo_fleet: bool = typer.Option(False, "--demo-fleet", help="Register a small demo fleet."),
) -> None:
    """Run the control-plane HTTP server."""
    import uvicorn

    from api.app import create_app
    from api.settings import Settings

    settings = Settings(host=host, port=port)
    uvicorn.run(create_app(settings), host=host, port=port)


@cli.command()
def migrate() -> None:
    """Upgrade the database to the newest schema."""
    typer.echo("no migrations yet")


def main() -> None:
    cli()
