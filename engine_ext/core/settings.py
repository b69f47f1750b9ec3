"""Engine-side configuration: the `R3_*` variables of README.md's engine table, read once per process."""

from __future__ import annotations

import os
import socket
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.spool import DEFAULT_SPOOL_DIR


class Mode(StrEnum):
    SIDECAR = "sidecar"  # write to the spool, drop the inline payload once the spool accepted it
    MIRROR = "mirror"  # write to the spool and keep SGLang's inline payload
    OFF = "off"  # buffer-sizing fixes only


class BudgetPolicy(StrEnum):
    ENFORCE = "enforce"  # refuse to start on a buffer the plugin cannot correct
    WARN = "warn"  # log the table and start anyway


class EngineSettings(BaseSettings):
    """What the plugin reads from the environment of each SGLang process."""

    model_config = SettingsConfigDict(env_prefix="R3_", extra="ignore")

    spool_dir: Path = DEFAULT_SPOOL_DIR
    mode: Mode = Mode.SIDECAR
    capture_all: bool = False
    spool_max_bytes: int = Field(0, ge=0, description="0: the spool file system's size.")
    dtype: str = Field("auto", pattern="^(auto|uint8|uint16|int16|int32)$")
    budget: BudgetPolicy = BudgetPolicy.WARN
    engine_id: str | None = Field(
        None, description="Default: `<host name>-<pid of the SGLang server process>`, distinct per engine on a node."
    )
    sidecar_url: str | None = None
    sidecar: Literal["off", "auto"] = Field(
        "off", description="`auto`: start or find this node's sidecar on the spool and point responses at it."
    )
    advertise_host: str | None = Field(
        None, description="The address pointers name (default: the node's routable one)."
    )
    sidecar_port: int = Field(0, ge=0, le=65535, description="Port of the node's sidecar (0: a free one).")
    sidecar_idle_s: float = Field(
        60.0,
        gt=0,
        description="The node's sidecar exits once no engine has reported for this long and no record is left.",
    )
    live_rows: bool = Field(False, description="Append rows as steps finish, for every captured request.")
    live_publish_s: float = Field(
        0.1,
        ge=0,
        description="Least time between two publishes of open records' rows (published together): one `.json` "
        "replace per record and one batch of sidecar events per interval, not per step.",
    )
    writer_queue_bytes: int = Field(256 << 20, ge=1 << 20, description="Bound of bytes awaiting the writer thread.")
    telemetry_interval_s: float = Field(1.0, gt=0)
    shutdown_wait_s: float = Field(
        10.0, ge=0, description="At an offline engine's shutdown: seconds to wait for the records responses point to."
    )
    build_check_records: int = Field(
        3,
        ge=1,
        description="On a build no test proved: records compared with the engine's own inline rows (SGLang's, "
        "vLLM's) before the plugin takes delivery over (until then sidecar mode acts as mirror).",
    )
    row_check: bool = Field(
        True,
        description="Check every row as it is written (a record no router could write is kept `suspect`); off "
        'only to measure what the check costs (BENCHMARKS.md, "Row check"): wrong routes are then served as `ok`.',
    )
    hook_timers: bool = Field(
        True, description="Time each scheduler-thread hook's own work (engine file `hooks`, r3_engine_hook_*)."
    )

    def engine_name(self, dp_rank: int | None) -> str:
        """Engine id of one scheduler process: `<R3_ENGINE_ID>/dp<rank>` (pid when the rank is unknown).

        Without `R3_ENGINE_ID` the id names the host and the SGLang server process (the schedulers' parent), so
        several engines on one node and spool keep distinct engine files with no per-engine setting."""
        base = self.engine_id or f"{socket.gethostname()}-{os.getppid()}"  # the scheduler's parent: the server
        return f"{base}/dp{dp_rank}" if dp_rank is not None else f"{base}/pid{os.getpid()}"
