"""One settings object, read from ``KVPLANE_*`` environment variables and passed explicitly."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SQLITE_PATH = Path("var") / "kvplane.db"


class Settings(BaseSettings):
    """Control-plane settings; every field can be set as ``KVPLANE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="KVPLANE_", extra="ignore")

    database_url: str = f"sqlite:///{DEFAULT_SQLITE_PATH}"
    host: str = "127.0.0.1"
    port: int = 8000
    log_json: bool = False
    #: Largest accepted request body; larger ones get 413 problem+json.
    max_body_bytes: int = 1 << 20
    #: Directory reads each worker may make a second (bursts of ``directory_burst``); a read
    #: over the pace waits up to 1 s for its turn, then answers 429. 0 turns pacing off.
    directory_reads_per_s: float = Field(default=10.0, ge=0)
    directory_burst: int = Field(default=20, ge=1)
    #: How long a SQLite writer waits for the lock before the request answers 503.
    sqlite_busy_timeout_ms: int = 5000
    #: Run ``alembic upgrade head`` when the app is created.
    migrate_on_startup: bool = False
    #: Register a small demo fleet (through the services) at startup if it is not there yet.
    demo_fleet: bool = False
    #: How long a worker's job lease lasts without a heartbeat before the job is retried.
    lease_ttl_s: float = 30.0
    #: Require bearer tokens (``kvplane tokens create``) on every route but /healthz, /readyz.
    auth: bool = False
    #: Key that signs dashboard session cookies; a random one per process when unset (then a
    #: session only works against the process that issued it: set it when running several).
    session_secret: SecretStr | None = None
    #: Lifetime of a dashboard session.
    session_ttl_s: int = 8 * 3600
    #: Most fragments one ``GET /v1/transfers/{id}/fragments`` answers (page with
    #: ``?offset=&limit=``); about 0.4 KB of server memory each while the page is built.
    max_fragments_per_page: int = Field(default=50_000, ge=1, le=1_000_000)
