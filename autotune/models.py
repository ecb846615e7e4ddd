"""The one registry of models: transformers configs as plain dicts, never downloaded.

Full-size entries carry their published architecture numbers; the small ones share the LLaMA
architecture so that a real CPU trial exercises the same code paths.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UserError


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config: dict[str, Any]
    seq_len: int  # default training sequence length for a study
    global_batch_size: int  # default sequences per optimizer step
    description: str = ""

    @property
    def n_params(self) -> int:
        return count_params(self.config)


def _llama(
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int | None = None,
    max_pos: int = 4096,
    **extra: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_cache": False,
    }
    cfg.update(extra)
    return cfg


REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            "tiny-llama",
            _llama(8192, 256, 688, 4, 4, max_pos=1024),
            seq_len=128,
            global_batch_size=16,
            description="LLaMA architecture, ~7M parameters, for real CPU trials",
        ),
        ModelEntry(
            "small-llama",
            _llama(32000, 512, 1376, 8, 8, max_pos=2048),
            seq_len=512,
            global_batch_size=16,
            description="LLaMA architecture, ~58M parameters, for real CPU trials",
        ),
        ModelEntry(
            "llama-7b",
            _llama(32000, 4096, 11008, 32, 32, max_pos=4096),
            seq_len=2048,
            global_batch_size=32,
            description="Llama 2 7B (Touvron et al. 2023)",
        ),
        ModelEntry(
            "llama-13b",
            _llama(32000, 5120, 13824, 40, 40, max_pos=4096),
            seq_len=2048,
            global_batch_size=32,
            description="Llama 2 13B",
        ),
        ModelEntry(
            "llama-70b",
            _llama(32000, 8192, 28672, 80, 64, kv_heads=8, max_pos=4096),
            seq_len=2048,
            global_batch_size=32,
            description="Llama 2 70B (grouped-query attention, 8 KV heads)",
        ),
        ModelEntry(
            "mistral-7b",
            {
                "model_type": "mistral",
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-5,
                "sliding_window": 4096,
                "tie_word_embeddings": False,
                "use_cache": False,
            },
            seq_len=2048,
            global_batch_size=32,
            description="Mistral 7B v0.1 (GQA, sliding window 4096)",
        ),
    ]
}

_REQUIRED = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def count_params(cfg: dict[str, Any]) -> int:
    """Parameter count of a LLaMA-style decoder from its config (no model is built)."""
    h = int(cfg["hidden_size"])
    v = int(cfg["vocab_size"])
    n_layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg.get("intermediate_size") or 4 * h)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * inter
    norms = 2 * h
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return n_layers * (attn + mlp + norms) + embed + h


def resolve_model(name_or_path: str) -> ModelEntry:
    """A registered name, or a path to a transformers ``config.json`` (local files only)."""
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise UserError(f"model config file not found: {name_or_path}")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"model config {name_or_path} is not valid JSON: {exc}") from None
        missing = [k for k in _REQUIRED if not isinstance(cfg, dict) or k not in cfg]
        if missing:
            raise UserError(
                f"{name_or_path} is not a causal-LM model config: missing {', '.join(missing)}"
            )
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "architectures"}
        cfg.setdefault("use_cache", False)
        return ModelEntry(path.stem, cfg, seq_len=512, global_batch_size=16, description=str(path))
    close = difflib.get_close_matches(name_or_path, list(REGISTRY), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"unknown model '{name_or_path}'{hint} (known: {', '.join(REGISTRY)})")
