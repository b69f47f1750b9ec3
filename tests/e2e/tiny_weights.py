"""Seeded random real weights for the tiny Qwen3-MoE, written as `model.safetensors` beside its `config.json`.

Why not `--load-format dummy`: SGLang's dummy loader fills every layer alike, so every layer of a token picks
the same experts and a swapped, reversed or shifted layer in a record would pass every real-server test. Here
each tensor is drawn from one seeded generator in a fixed order (same seed, same bytes), the routers are
large (std 1 against RMS-normalised hidden states: wide top-k margins) and differ per
layer, so routing differs per layer and per token. The special ids (0-2) get zero `lm_head` rows: their
logit is exactly 0 while the others spread with std ~1, so greedy decoding never stops early on EOS.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"
SPECIAL_IDS = 3  # <unk>, <s>, </s>: never the argmax


def supports(config: dict[str, Any]) -> bool:
    """Whether `write_weights` knows this architecture's tensor names (Qwen3-MoE only; others stay dummy)."""
    return config.get("model_type") == "qwen3_moe"


def qwen3_moe_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """HF Qwen3-MoE tensor names → seeded random tensors; every layer sparse (what SGLang's model builds)."""
    import torch

    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    experts, inter = int(config["num_experts"]), int(config["moe_intermediate_size"])
    dtype = getattr(torch, str(config.get("torch_dtype", "bfloat16")))
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, dtype=torch.float32) * std).to(dtype).contiguous()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, hidden, std=1.0)}
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = ones(hidden)
        out[p + "post_attention_layernorm.weight"] = ones(hidden)
        out[p + "self_attn.q_proj.weight"] = randn(heads * head_dim, hidden, std=1 / math.sqrt(hidden))
        out[p + "self_attn.k_proj.weight"] = randn(kv_heads * head_dim, hidden, std=1 / math.sqrt(hidden))
        out[p + "self_attn.v_proj.weight"] = randn(kv_heads * head_dim, hidden, std=1 / math.sqrt(hidden))
        out[p + "self_attn.o_proj.weight"] = randn(hidden, heads * head_dim, std=1 / math.sqrt(heads * head_dim))
        out[p + "self_attn.q_norm.weight"] = ones(head_dim)
        out[p + "self_attn.k_norm.weight"] = ones(head_dim)
        out[p + "mlp.gate.weight"] = randn(experts, hidden, std=1.0)
        for expert in range(experts):
            q = f"{p}mlp.experts.{expert}."
            out[q + "gate_proj.weight"] = randn(inter, hidden, std=1 / math.sqrt(hidden))
            out[q + "up_proj.weight"] = randn(inter, hidden, std=1 / math.sqrt(hidden))
            out[q + "down_proj.weight"] = randn(hidden, inter, std=1 / math.sqrt(inter))
    out["model.norm.weight"] = ones(hidden)
    lm_head = randn(vocab, hidden, std=1 / math.sqrt(hidden))
    lm_head[:SPECIAL_IDS] = 0
    out["lm_head.weight"] = lm_head
    return out


def write_weights(directory: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Write `model.safetensors` for `config` into `directory`; the same seed writes the same bytes."""
    from safetensors.torch import save_file

    path = directory / WEIGHTS_FILE
    save_file(qwen3_moe_tensors(config, seed), str(path), metadata={"format": "pt"})
    return path
