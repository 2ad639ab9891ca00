"""The ``kvplane`` command line."""

from __future__ import annotations

import typer

cli = typer.Typer(help="kvplane: control plane for disaggregated LLM serving.", no_args_is_help=True)


@cli.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, help="Port to bind."),
    demo_fleet: bool = typer.Option(False, "--demo-fleet", help="Register a small demo fleet."),
    migrate: bool = typer.Option(
        True, "--migrate/--no-migrate", help="Upgrade the database to the newest schema first."
    ),
) -> None:
    """Run the control-plane HTTP server (API docs at /docs)."""
    import uvicorn

    from api.app import create_app
    from api.settings import Settings

    settings = Settings(host=host, port=port, demo_fleet=demo_fleet, migrate_on_startup=migrate)
    typer.echo(f"kvplane on http://{host}:{port} (API docs: /docs), database {settings.database_url}")
    uvicorn.run(create_app(settings), host=host, port=port)


@cli.command()
def migrate() -> None:
    """Upgrade the database (``KVPLANE_DATABASE_URL``, default SQLite file) to the newest schema."""
    from api.migrate import upgrade
    from api.settings import Settings

    settings = Settings()
    upgrade(settings.database_url)
    typer.echo(f"migrated {settings.database_url} to head")


def main() -> None:
    cli()
