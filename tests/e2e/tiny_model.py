"""The tiny Qwen3-MoE's directory as the real-server harness (`sglang_server.py`) hands it to SGLang: `config.json`
from `tests/sglang_cpu/tiny_qwen3moe` with the test's overrides (`GLM`: a dense+MoE layout), seeded random real
weights where `tiny_weights.py` knows the architecture, and a word-level tokenizer with a chat template for the
text and OpenAI endpoints (a server without `--skip-tokenizer-init`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny_weights import supports, write_weights

TINY_MODEL = Path(__file__).resolve().parents[2] / "tests" / "sglang_cpu" / "tiny_qwen3moe" / "config.json"

# GLM-4.5's layout (first_k_dense_replace): layer 0 dense, layers 1-2 MoE, one shared expert
GLM = {  # model overrides for `Config(model=GLM)`
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": False,
    "attention_bias": False,
}


def write_model(directory: Path, *, weights: bool = True, **overrides: Any) -> Path:
    """The tiny Qwen3-MoE's directory, 4 layers, 2048 positions by default: `config.json` and, where
    `tiny_weights` knows the architecture and `weights` is set, seeded random `model.safetensors`."""
    config = json.loads(TINY_MODEL.read_text())
    config.update({"num_hidden_layers": 4, "max_position_embeddings": 2048} | overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if weights and supports(config):
        write_weights(directory, config)
    return directory


def load_format(model_dir: Path) -> str:
    """`auto` where real weights were written, else `dummy` (SGLang's deterministic fill)."""
    return "auto" if (model_dir / "model.safetensors").exists() else "dummy"


# The tiny model's 256 ids as a word-level tokenizer: text and chat endpoints run without --skip-tokenizer-init.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0-4; bos 1, eos 2 as config.json
ROLE_WORDS = ["system", "user", "assistant"]  # ids 5-7, so the chat template's roles are real tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def word(token_id: int) -> str:
    """The word of a plain (non-special) id: `w8` … `w255`."""
    return f"w{token_id}"


def write_tokenizer(directory: Path, vocab_size: int = 256) -> Path:
    """`tokenizer.json` + `tokenizer_config.json` (with a chat template) over `vocab_size` ids, built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    names = SPECIAL_TOKENS + ROLE_WORDS
    vocab = {name: i for i, name in enumerate(names)} | {word(i): i for i in range(len(names), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
