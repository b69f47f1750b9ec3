"""Step-scoped acknowledgement: free many records in one call, by rid or by weight version.

Why: a trainer step consumes a few thousand rollouts; one `DELETE` per rid is a few thousand round trips, and
an off-policy trainer that moved past weight version `v` wants everything older gone without listing it.
`POST /routed_experts/ack` takes exactly one of `{"rids": [...]}` and `{"before_weight_version": v}`.

Versions are ordered only when both are integers (or strings of one: SGLang's versions are strings, and RL
trainers use the step number, e.g. verl's `global_steps`); a record whose version is not one is kept and
counted in the answer's `unordered`, so nothing is freed by a guess. Only final records are freed by version:
an open one is still being written by a request that spans the update.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from service.server.record_answer import MAX_RID_CHARS

_INTEGER = re.compile(r"[+-]?\d{1,30}")


def version_number(version: object) -> int | None:
    """A weight version as an integer, when it is one (`7`, `"7"`); None otherwise (`"default"`, `"v7"`)."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str) and _INTEGER.fullmatch(version.strip()):
        return int(version)
    return None


def ack_request_model(max_rids: int) -> type[BaseModel]:
    """The ack body with this app's limit on rids (`R3_MAX_BATCH`) in its schema."""

    class AckRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        rids: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_RID_CHARS)]] | None = Field(
            None, max_length=max_rids, description="Records to free; unknown rids are listed in `missing`."
        )
        before_weight_version: int | str | None = Field(
            None,
            description="Free every final record whose `weight_version` is an integer below this one (an integer, "
            "or a string of one).",
        )

        @model_validator(mode="after")
        def exactly_one(self) -> Any:
            if (self.rids is None) == (self.before_weight_version is None):
                raise ValueError('give exactly one of "rids" and "before_weight_version"')
            if self.before_weight_version is not None and version_number(self.before_weight_version) is None:
                raise ValueError(
                    f"before_weight_version={self.before_weight_version!r} is not an integer: versions are ordered "
                    'only as integers; free other versions by "rids"'
                )
            return self

    return AckRequest
