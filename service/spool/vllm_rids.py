"""Record rids for vLLM requests: the response id the client knows, plus the choice index where it has several.

Why not the engine's id: vLLM adds 8 random characters to every request inside the engine
(`v1/engine/input_processor.py` `assign_request_id`), so a trainer could never name it. vLLM's OpenAI server
(0.32) builds its ids from `B`, the `X-Request-Id` header, else the body's `request_id`, else a random id:

- a completion's response id is `cmpl-B`; prompt `i` runs as the request `cmpl-B-<i>` (vLLM's "external id");
- a chat completion's response id is `chatcmpl-B`, and so is its one request;
- with `n > 1` vLLM runs child `j` of a request as `<j>_<external id>` (`v1/engine/parallel_sampling.py`).

A record's rid is what the response itself says, with no `n` to know: completion choice `k` is
`cmpl-B-<k>` (prompt `i`, child `j` is choice `i * n + j`; with `n = 1` that is vLLM's external id); a chat
response's one choice is `chatcmpl-B`, and with `n > 1` choice `j` is `chatcmpl-B-<j>`. Requests from other
front doors keep their external id (`-<j>` per child).

Both halves of the rule live here because both sides need one of them and they must agree: the plugin names a
record from the engine's request (`record_rid`) and points a response's choice at it (`vllm_choice_rid`); a
client without the pointer names the record from the response alone (`vllm_choice_rid`).
"""

from __future__ import annotations

import re

_COMPLETION = re.compile(r"^(cmpl-.+)-(\d+)$")


def record_rid(external_id: str, child: int | None = None, n: int = 1) -> str:
    """The record of one engine request: external id `external_id`, child `child` of `n` (None: no children)."""
    if child is None:
        return external_id
    completion = _COMPLETION.match(external_id)
    if completion:
        return f"{completion.group(1)}-{int(completion.group(2)) * n + child}"
    return f"{external_id}-{child}"


def vllm_choice_rid(response_id: str, index: int, choices: int) -> str:
    """The record rid of choice `index` of a vLLM response with `choices` choices: `cmpl-B-<index>` for a
    completion; `chatcmpl-B` for a chat response's one choice, `chatcmpl-B-<index>` when it has several
    (`n > 1`)."""
    if response_id.startswith("chatcmpl-") and choices == 1:
        return response_id
    return f"{response_id}-{index}"
