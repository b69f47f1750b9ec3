"""Record rids for vLLM requests: the id the client sent, as vLLM extends it per prompt and per `n` child.

Why not the engine's id: vLLM adds 8 random characters to every request inside the engine
(`v1/engine/input_processor.py` `assign_request_id`), so a trainer could never name it. The rules, from vLLM's
OpenAI server (0.32), with `B` the `X-Request-Id` header, else the body's `request_id`, else a random id:

- a completion's response id is `cmpl-B`; prompt `i` of it is the request `cmpl-B-<i>` (vLLM's "external id");
- a chat completion's response id is `chatcmpl-B`, and so is its one request;
- with `n > 1` vLLM runs child `j` as `<j>_<external id>` (`v1/engine/parallel_sampling.py`).

A record's rid is the external id, `<j>_<external id>` for child `j` of an `n > 1` request. Choice `k` of a
completion response with `n` samples per prompt is prompt `k // n`, child `k % n`; of a chat response, child `k`.
Pure functions: the plugin names records with `record_rid`, clients find them with `choice_rid`.
"""

from __future__ import annotations


def record_rid(external_id: str, child: int | None) -> str:
    """The record of one engine request: its external id, or `<child>_<external id>` for an `n > 1` child."""
    return external_id if child is None else f"{child}_{external_id}"


def choice_rid(response_id: str, index: int, n: int = 1) -> str:
    """The record of choice `index` of a vLLM completion (`cmpl-…`) or chat completion (`chatcmpl-…`) response."""
    if n < 1 or index < 0:
        raise ValueError(f"choice index {index} with n={n}: n must be >= 1, the index >= 0")
    child = index % n if n > 1 else None
    if response_id.startswith("chatcmpl-"):
        if n == 1 and index:
            raise ValueError(f"a chat response with n=1 has one choice, not choice {index}")
        return record_rid(response_id, index if n > 1 else None)
    return record_rid(f"{response_id}-{index // n}", child)
