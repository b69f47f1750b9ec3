"""`vllm_wheel_fit` on a small made-up `vllm` package: each fact it reads is found, or named when it is not.

Why: the release wheels' test (`test_vllm_release_wheels.py`) passes when every release fits its own row, which a
reader that finds everything would pass too; here each check is seen to fail: a hook target gone, a re-export
followed, the capture flag's field and its class, a parameter a hook passes on renamed, a name it reads dropped,
a target of another kind than its hook, an attribute the hooks read.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import vllm_wheel_fit
from source_names import Source

from engine_ext.vllm.versions import MATRIX

_OP = "v1/engine/output_processor.py"
FILES = {
    "config/__init__.py": "from vllm.config.vllm import VllmConfig\nfrom vllm.config.aux import AuxOutputConfig\n"
    "from vllm.config.model import ModelConfig\n",
    "config/vllm.py": "from vllm.config.aux import AuxOutputConfig\nclass VllmConfig:\n"
    "    model_config: 'ModelConfig' = None\n    aux_output_config: AuxOutputConfig = None\n",
    "config/aux.py": "class AuxOutputConfig:\n    enable_return_routed_experts: bool = False\n",
    "config/model.py": "class ModelConfig:\n    def get_num_experts(self): ...\n"
    "    def get_num_experts_per_tok(self): ...\n",
    "v1/engine/async_llm.py": "class AsyncLLM:\n    def __init__(self, vllm_config, client_index=0): ...\n",
    _OP: "class OutputProcessor:\n    def add_request(self, request, prompt=None): ...\n"
    "class RequestState:\n    def __init__(self):\n        self.prompt_len = 0\n"
    "    def _new_completion_output(self, token_ids): ...\n",
    "entrypoints/openai/completion/serving.py": """
        class OpenAIServingCompletion:
            def request_output_to_completion_response(self, final_res_batch, request, request_id): ...
            async def completion_stream_generator(
                self, request, gens, request_id, created_time, model_name, num_prompts
            ):
                yield ""
    """,
    "entrypoints/openai/chat_completion/serving.py": """
        from vllm.entrypoints.openai.chat_completion.base import OpenAIServingChat
    """,
    "entrypoints/openai/chat_completion/base.py": """
        class OpenAIServingChat:
            async def chat_completion_full_generator(self, request, gen, request_id): ...
            async def chat_completion_stream_generator(self, request, gen, request_id, model_name):
                yield ""
    """,
}


def made_up(root: Path, changes: dict[str, tuple[str, str]] | None = None) -> Source:
    """The package above under `root`, each file's text with `changes` (file → (old, new)) made."""
    for name, text in FILES.items():
        text = textwrap.dedent(text).lstrip()
        old, new = (changes or {}).get(name, ("", ""))
        path = root / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace(old, new) if old else text)
    return Source(root / "vllm", "vllm")


def test_the_made_up_package_fits_the_connector_rows_and_binds_every_hook(tmp_path: Path):
    source = made_up(tmp_path)
    assert vllm_wheel_fit.lacks(source, MATRIX["0.33.0"]) == []  # the chat class through a re-export
    assert vllm_wheel_fit.binding_gaps(source) == []
    stream = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator"
    assert vllm_wheel_fit.optional_absent(source)[stream] == ["created_time", "num_prompts"]


@pytest.mark.parametrize(
    ("changes", "row", "gap"),
    [
        ({_OP: ("def add_request", "def add")}, "0.33.0", "OutputProcessor.add_request"),
        ({"config/aux.py": ("enable_return_routed_experts", "other")}, "0.33.0", "aux_output_config.enable_"),
        ({"config/vllm.py": ("aux_output_config", "aux")}, "0.33.0", "VllmConfig.aux_output_config"),
        ({}, "0.27.1", "model_config.enable_return_routed_experts"),
        ({}, "0.24.0", "routed_experts_capturer:get_num_experts"),
    ],
)
def test_what_a_row_lacks_is_named(tmp_path: Path, changes: dict, row: str, gap: str):
    assert any(gap in found for found in vllm_wheel_fit.lacks(made_up(tmp_path, changes), MATRIX[row]))


_COMPLETION = "entrypoints/openai/completion/serving.py"


@pytest.mark.parametrize(
    ("changes", "gap"),
    [
        ({_COMPLETION: ("final_res_batch, request,", "batch, request,")}, "_pointers passes ('self', 'final_"),
        ({_OP: ("self, request, prompt", "self, req, prompt")}, "_around_add_request passes ('self', 'request')"),
        ({_COMPLETION: ("gens, request_id", "gens, rid")}, "no parameter 'request_id' (_stream_pointers reads"),
        ({_COMPLETION: ("num_prompts", "prompts")}, "_stream_pointers: no target has 'num_prompts'"),
        ({"v1/engine/async_llm.py": ("client_index", "index")}, "_around_async_llm_init: no target has 'client_"),
        ({_OP: ("def _new_completion_output(self, token_ids): ...", "_new_completion_output = max")}, "not a def"),
        ({_COMPLETION: ("def request_output", "async def request_output")}, "'coroutine function', _pointers"),
        ({_COMPLETION: ("async def completion_stream", "def completion_stream")}, "'plain function', _stream_p"),
    ],
)
def test_a_parameter_a_hook_binds_that_the_target_lacks_is_named(tmp_path: Path, changes: dict, gap: str):
    gaps = vllm_wheel_fit.binding_gaps(made_up(tmp_path, changes))
    assert any(gap in found for found in gaps), gaps


def test_an_attribute_the_hooks_read_that_a_class_lacks_is_named(tmp_path: Path):
    gaps = vllm_wheel_fit.attribute_gaps(made_up(tmp_path))
    assert "vllm.v1.engine.output_processor.RequestState.routed_experts_chunks" in gaps
    assert "vllm.v1.engine.output_processor.RequestState.prompt_len" not in gaps  # its constructor sets it
    assert "vllm.outputs.CompletionOutput (no such class)" in gaps
