"""Sidecar configuration: every field from an `R3_*` environment variable or a CLI flag."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.spool import DEFAULT_SPOOL_DIR


class Settings(BaseSettings):
    """What the sidecar reads once at start (docs/design.md, Contract 2)."""

    model_config = SettingsConfigDict(env_prefix="R3_", extra="ignore")

    spool_dir: Path = Field(DEFAULT_SPOOL_DIR, description="The spool the engines write (a tmpfs directory).")
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    auth_token: str | None = Field(None, description="Bearer token every route but the probes requires.")
    ttl_s: float = Field(900.0, gt=0, description="Seconds a final record is kept before deletion.")
    stale_s: float = Field(300.0, gt=0, description="Seconds without update before a non-final record is aborted.")
    spool_max_bytes: int = Field(0, ge=0, description="Spool capacity; 0 means the file system's size (statvfs).")
    rescan_s: float = Field(5.0, gt=0, description="Safety-net rescan period behind file-system events.")
    max_wait_s: float = Field(600.0, ge=0, description="Upper bound of the `wait` parameter.")
    max_batch: int = Field(1024, ge=1, description="Most rids one batch request may name.")
    chunk_bytes: int = Field(1 << 20, ge=4096, description="Body chunk size when streaming large records.")
    engine_stale_s: float = Field(10.0, gt=0, description="Engine file age after which r3_engine_stale is 1.")
    idle_exit_s: float = Field(
        0.0,
        ge=0,
        description="Exit once no engine has reported for this long and no record is left (0: never; the per-node "
        "sidecar of R3_SIDECAR=auto sets it).",
    )
    exit_with_pid: int = Field(0, ge=0, description="Exit when this process is gone (0: none; e.g. Ray's raylet).")
    send_timeout_s: float = Field(
        60.0, ge=0, description="Close a response whose reader takes no bytes for this long (0: never)."
    )
