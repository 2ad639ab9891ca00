"""One settings object, read from ``KVPLANE_*`` environment variables and passed explicitly."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SQLITE_PATH = Path("var") / "kvplane.db"


class Settings(BaseSettings):
    """Control-plane settings; every field can be set as ``KVPLANE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="KVPLANE_", extra="ignore")

    database_url: str = f"sqlite:///{DEFAULT_SQLITE_PATH}"
    host: str = "127.0.0.1"
    port: int = 8000
    log_json: bool = False
