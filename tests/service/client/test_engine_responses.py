"""What an engine's response says, read with no sidecar to ask: a pointer's sidecar base and rid (an ingress's
path prefix kept), the shape the engine states beside its inline rows, and what a ref whose inline rows state
no shape asks the caller for. The same refs against live sidecars are `test_client_refs.py`'s."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from engine_ext.sglang.frontdoors import inline_shape
from service.client import R3Error, RoutedExpertsRef
from service.client.engine_responses import sidecar_base, split_pointer

HIDDEN = 6  # test_client_refs.py's model: 6 layers, top-4 (any whole rows would do)
TOPK = 4


@pytest.mark.parametrize(
    ("url", "base", "rid"),
    [
        ("http://h:8000/routed_experts/abc", "http://h:8000", "abc"),
        ("http://h:8000/pod-a/routed_experts/a%2Fb%20c", "http://h:8000/pod-a", "a/b c"),
        ("https://h/routed_experts/x?wait=3", "https://h", "x"),
    ],
)
def test_split_pointer(url: str, base: str, rid: str) -> None:
    assert split_pointer(url) == (base, rid)
    assert sidecar_base(url) == base and sidecar_base(base + "/") == base


def test_pointer_path_prefix(tmp_path: Path) -> None:
    """A sidecar behind a path prefix (an ingress): the base keeps the prefix."""
    assert sidecar_base("http://gw/pod-a/routed_experts/r1") == "http://gw/pod-a"


def test_inline_shape_from_the_engines_payloads() -> None:
    """The engine side: SGLang's base64 string and the tensor of `skip_tokenizer_init` (any `numel()`)."""
    rows = np.arange(5 * HIDDEN * TOPK, dtype="<i4")
    text = base64.b64encode(rows.tobytes()).decode()
    assert inline_shape(text, num_hidden_layers=HIDDEN, topk=TOPK, start_len=2) == {
        "routed_experts_shape": [5, HIDDEN, TOPK],
        "routed_experts_start_len": 2,
    }
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(rows.reshape(5, HIDDEN, TOPK))
    assert inline_shape(tensor, num_hidden_layers=HIDDEN, topk=TOPK, start_len=0)["routed_experts_shape"][0] == 5
    assert inline_shape("", num_hidden_layers=HIDDEN, topk=TOPK, start_len=0) is None
    assert inline_shape(text, num_hidden_layers=7, topk=TOPK, start_len=0) is None  # not whole rows: say nothing


def test_inline_without_the_model_shape_says_what_to_pass() -> None:
    text = "AAAAAAAAAAA="  # 8 bytes: two int32
    resp = {"meta_info": {"id": "x", "routed_experts": text}}
    (ref,) = RoutedExpertsRef.from_response(resp)
    with pytest.raises(R3Error, match="num_hidden_layers and topk"):
        ref.fetch()
