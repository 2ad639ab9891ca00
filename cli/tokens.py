"""``kvplane tokens``: create, list and revoke API tokens directly on the database.

These commands talk to ``KVPLANE_DATABASE_URL`` (not to a server), so the first admin token can
be made before anything runs. The secret is printed once, at creation; only its hash is stored.
"""

from __future__ import annotations

import json

import typer

from api.auth import BOUND_SCOPES, SCOPES, create_token, list_tokens, revoke_token
from cli.ops import database_errors

tokens_app = typer.Typer(
    help="Create, list and revoke API tokens (works on the database directly).",
    no_args_is_help=True,
)


def _url() -> str:
    from api.settings import Settings

    return Settings().database_url


def _database():  # type: ignore[no-untyped-def]
    from api.db import Database

    return Database(_url())


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


@tokens_app.command("create")
def create(
    scope: str = typer.Option(..., help=f"One of: {', '.join(SCOPES)}."),
    instance: str | None = typer.Option(
        None, help=f"Instance the token is bound to (required for {' and '.join(BOUND_SCOPES)})."
    ),
    name: str = typer.Option("", help="A label for humans (who or what holds the token)."),
    rank: int | None = typer.Option(
        None,
        help="Bind a worker token to one rank of its instance (then it acts only for that "
        "rank's workers and jobs). Without it a worker token acts for every rank.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print id, scope and secret as JSON."),
) -> None:
    """Create a token and print its secret (shown once: store it now)."""
    from api.errors import KvplaneError

    db = _database()
    try:
        with database_errors(_url()), db.write() as session:
            row, secret = create_token(
                session=session, scope=scope, instance=instance, name=name, rank=rank
            )
            token_id = row.id
    except KvplaneError as error:
        raise _fail(error.detail) from None
    finally:
        db.dispose()
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "id": token_id,
                    "scope": scope,
                    "instance": instance,
                    "rank": rank,
                    "name": name,
                    "token": secret,
                }
            )
        )
        return
    bound = f" for instance {instance}" if instance else ""
    if rank is not None:
        bound = f" for rank {rank} of instance {instance}"
    typer.echo(f"token {token_id}: scope {scope}{bound}")
    typer.echo(secret)
    typer.echo("(the secret is shown only now; kvplane stores its hash)", err=True)


@tokens_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON lines.")) -> None:
    """List tokens (never their secrets)."""
    db = _database()
    try:
        with database_errors(_url()), db.read() as session:
            rows = [
                {
                    "id": row.id,
                    "scope": row.scope,
                    "instance": row.instance,
                    "rank": row.rank,
                    "name": row.name,
                    "created_at": row.created_at.isoformat(timespec="seconds"),
                    "revoked_at": row.revoked_at.isoformat(timespec="seconds")
                    if row.revoked_at
                    else None,
                }
                for row in list_tokens(session=session)
            ]
    finally:
        db.dispose()
    if as_json:
        for item in rows:
            typer.echo(json.dumps(item))
        return
    header = f"{'id':<32}  {'scope':<8}  {'instance[/rank]':<20}  {'name':<20}"
    typer.echo(f"{header}  created / revoked")
    for item in rows:
        state = f"revoked {item['revoked_at']}" if item["revoked_at"] else "active"
        bound = item["instance"] or "-"
        if item["rank"] is not None:
            bound = f"{bound}/{item['rank']}"
        typer.echo(
            f"{item['id']:<32}  {item['scope']:<8}  {bound:<20}  "
            f"{item['name'] or '-':<20}  {item['created_at']}  {state}"
        )


@tokens_app.command("revoke")
def revoke(
    token_id: str = typer.Argument(..., help="The token's id (from `tokens list`)."),
) -> None:
    """Revoke a token: requests and dashboard sessions using it are refused from now on."""
    from api.errors import KvplaneError

    db = _database()
    try:
        with database_errors(_url()), db.write() as session:
            revoke_token(session=session, token_id=token_id)
    except KvplaneError as error:
        raise _fail(error.detail) from None
    finally:
        db.dispose()
    typer.echo(f"revoked {token_id}")
