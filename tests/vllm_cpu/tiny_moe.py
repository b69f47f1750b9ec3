"""A tiny random-weight Qwen3-MoE that vLLM loads from real safetensors: routing differs per layer and token.

Why not `--load-format dummy`: vLLM's dummy loader gives every layer the same router, so every layer routes
alike and a layer mix-up could not fail a test. Here each tensor comes from one seeded generator, the router
weights are large against RMS-normalised hidden states (wide top-k margins, stable in bfloat16), and the
byte-level tokenizer (ids 0-255 are bytes, then the specials) makes text prompts deterministic token ids.
The same seed writes byte-identical files. Needs torch, safetensors and tokenizers (the vLLM venv has them).

    python tests/vllm_cpu/tiny_moe.py OUT_DIR [LAYERS EXPERTS TOPK]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = 256  # <|endoftext|>


def _byte_chars() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable stand-in for each byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


def write_tokenizer(out: Path, max_len: int) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIALS[0],
        "pad_token": SPECIALS[0],
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return 256 + len(SPECIALS)


def write_model(out: Path, *, layers: int = 4, experts: int = 16, topk: int = 4, seed: int = 0) -> Path:
    """Config, weights and tokenizer of the tiny model in `out` (head_dim 32: vLLM's CPU attention needs it)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hidden, heads, kv_heads, head_dim, inter, max_pos = 64, 4, 2, 32, 32, 32768
    vocab = write_tokenizer(out, max_pos)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "pad_token_id": EOS}))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16).contiguous()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": randn(vocab, hidden, std=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden, std=1 / math.sqrt(hidden)),
            p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden, std=1 / math.sqrt(hidden)),
            p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden, std=1 / math.sqrt(hidden)),
            p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim, std=1 / math.sqrt(heads * head_dim)),
            p + "self_attn.q_norm.weight": ones(head_dim),
            p + "self_attn.k_norm.weight": ones(head_dim),
            p + "mlp.gate.weight": randn(experts, hidden, std=1.0),  # the router: wide top-k margins
        }
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t |= {
                q + "gate_proj.weight": randn(inter, hidden, std=1 / math.sqrt(hidden)),
                q + "up_proj.weight": randn(inter, hidden, std=1 / math.sqrt(hidden)),
                q + "down_proj.weight": randn(hidden, inter, std=1 / math.sqrt(inter)),
            }
    t["model.norm.weight"] = ones(hidden)
    t["lm_head.weight"] = randn(vocab, hidden, std=1 / math.sqrt(hidden))
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    shape = dict(zip(("layers", "experts", "topk"), map(int, sys.argv[2:5]), strict=False))
    print(write_model(Path(sys.argv[1]), **shape))
