"""The one registry of models: transformers configs as plain dicts, never downloaded.

Full-size entries carry the numbers of their published ``config.json`` (architecture keys only);
the small ones share the LLaMA architecture so that a real CPU trial exercises the same code
paths. Any other decoder that transformers builds as a causal LM from a config works too (a path
to its ``config.json``): its parameter shapes come from the transformers model itself, built on
the meta device (no memory, no weights), so counts are exactly what training would hold.
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from autotune.errors import UserError
from autotune.model_source import check_weights, model_folder


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config: dict[str, Any]
    seq_len: int  # a study's default training sequence length, in tokens
    global_batch_size: int  # a study's default sequences per optimizer step
    description: str = ""
    #: the model folder its pretrained weights are loaded from (None: random init)
    weights: str | None = None

    @property
    def n_params(self) -> int:
        return count_params(self.config)


def _llama(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    max_position_embeddings: int = 4096,
    model_type: str = "llama",
    **extra: Any,
) -> dict[str, Any]:
    """A LLaMA-architecture config.json, its sizes named as transformers names them (``extra``:
    any further keys, as they stand in the published config)."""
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads or num_attention_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_cache": False,
    }
    cfg.update(extra)
    return cfg


def _entry(
    *, name: str, config: dict[str, Any], description: str, seq_len: int = 2048
) -> ModelEntry:
    """A published model's row: a study's defaults of ``seq_len`` tokens, 32 sequences a step."""
    return ModelEntry(
        name=name, config=config, seq_len=seq_len, global_batch_size=32, description=description
    )


LLAMA2_7B = _llama(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
)
LLAMA2_13B = _llama(
    vocab_size=32000,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=40,
    num_attention_heads=40,
)
LLAMA2_70B = _llama(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
LLAMA3: dict[str, Any] = {
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

#: Llama 3.1/3.2's RoPE frequency scaling (their config.json's ``rope_scaling``)
LLAMA31_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31: dict[str, Any] = {
    **LLAMA3,
    "max_position_embeddings": 131072,
    "rope_scaling": LLAMA31_ROPE,
}

MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            name="tiny-llama",
            config=_llama(
                vocab_size=8192,
                hidden_size=256,
                intermediate_size=688,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=1024,
            ),
            seq_len=128,
            global_batch_size=16,
            description="LLaMA architecture, ~7M parameters, for real CPU trials",
        ),
        ModelEntry(
            name="small-llama",
            config=_llama(
                vocab_size=32000,
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=8,
                num_attention_heads=8,
                max_position_embeddings=2048,
            ),
            seq_len=512,
            global_batch_size=16,
            description="LLaMA architecture, ~58M parameters, for real CPU trials",
        ),
        # the short names are kept for existing studies: they are Llama 2
        _entry(name="llama-7b", config=LLAMA2_7B, description="Llama 2 7B (Touvron et al. 2023)"),
        _entry(name="llama-13b", config=LLAMA2_13B, description="Llama 2 13B"),
        _entry(
            name="llama-70b",
            config=LLAMA2_70B,
            description="Llama 2 70B (grouped-query attention, 8 KV heads)",
        ),
        _entry(name="llama-2-7b", config=LLAMA2_7B, description="meta-llama/Llama-2-7b-hf"),
        _entry(name="llama-2-13b", config=LLAMA2_13B, description="meta-llama/Llama-2-13b-hf"),
        _entry(name="llama-2-70b", config=LLAMA2_70B, description="meta-llama/Llama-2-70b-hf"),
        _entry(
            name="llama-3-8b",
            config=_llama(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                **LLAMA3,
            ),
            description="meta-llama/Meta-Llama-3-8B",
        ),
        _entry(
            name="llama-3.1-8b",
            config=_llama(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                **LLAMA31,
            ),
            description="meta-llama/Llama-3.1-8B",
        ),
        _entry(
            name="llama-3.2-3b",
            config=_llama(
                vocab_size=128256,
                hidden_size=3072,
                intermediate_size=8192,
                num_hidden_layers=28,
                num_attention_heads=24,
                num_key_value_heads=8,
                **{**LLAMA31, "tie_word_embeddings": True},
            ),
            description="meta-llama/Llama-3.2-3B (tied embeddings)",
        ),
        _entry(
            name="llama-3.2-1b",
            config=_llama(
                vocab_size=128256,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                **{**LLAMA31, "tie_word_embeddings": True},
            ),
            description="meta-llama/Llama-3.2-1B (tied embeddings)",
        ),
        _entry(
            name="llama-3-70b",
            config=_llama(
                vocab_size=128256,
                hidden_size=8192,
                intermediate_size=28672,
                num_hidden_layers=80,
                num_attention_heads=64,
                num_key_value_heads=8,
                **LLAMA3,
            ),
            description="meta-llama/Meta-Llama-3-70B",
        ),
        _entry(
            name="mistral-7b",
            config=_llama(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                max_position_embeddings=32768,
                model_type="mistral",
                sliding_window=4096,
                rope_theta=10000.0,
            ),
            description="mistralai/Mistral-7B-v0.1 (GQA, sliding window 4096)",
        ),
        _entry(
            name="qwen2.5-7b",
            config=_llama(
                vocab_size=152064,
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                max_position_embeddings=131072,
                model_type="qwen2",
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                bos_token_id=151643,
                eos_token_id=151643,
                use_sliding_window=False,
            ),
            description="Qwen/Qwen2.5-7B (q/k/v biases)",
        ),
        _entry(
            name="qwen3-8b",
            config=_llama(
                vocab_size=151936,
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=36,
                num_attention_heads=32,
                num_key_value_heads=8,
                max_position_embeddings=40960,
                model_type="qwen3",
                head_dim=128,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                bos_token_id=151643,
                eos_token_id=151645,
            ),
            description="Qwen/Qwen3-8B (q/k norms)",
        ),
        _entry(
            name="mixtral-8x7b",
            config=_llama(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                max_position_embeddings=32768,
                model_type="mixtral",
                num_local_experts=8,
                num_experts_per_tok=2,
                rope_theta=1000000.0,
            ),
            description="mistralai/Mixtral-8x7B-v0.1 (MoE: 8 experts, 2 per token)",
        ),
        _entry(
            name="gemma-2-9b",
            config={
                "model_type": "gemma2",
                "vocab_size": 256000,
                "hidden_size": 3584,
                "intermediate_size": 14336,
                "num_hidden_layers": 42,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256,
                "sliding_window": 4096,
                "final_logit_softcapping": 30.0,
                "attn_logit_softcapping": 50.0,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True,
                "use_cache": False,
            },
            description="google/gemma-2-9b (tied embeddings, 256k vocabulary)",
        ),
        _entry(
            name="phi-3-mini",
            config=_llama(
                vocab_size=32064,
                hidden_size=3072,
                intermediate_size=8192,
                num_hidden_layers=32,
                num_attention_heads=32,
                model_type="phi3",
                bos_token_id=1,
                eos_token_id=32000,
                pad_token_id=32000,
            ),
            description="microsoft/Phi-3-mini-4k-instruct (fused qkv and gate/up)",
        ),
        _entry(
            name="pythia-6.9b",
            config={
                "model_type": "gpt_neox",
                "vocab_size": 50432,
                "hidden_size": 4096,
                "intermediate_size": 16384,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "rotary_pct": 0.25,
                "max_position_embeddings": 2048,
                "tie_word_embeddings": False,
                "use_cache": False,
            },
            description="EleutherAI/pythia-6.9b (GPT-NeoX)",
        ),
        _entry(
            name="gpt2-xl",
            config={
                "model_type": "gpt2",
                "vocab_size": 50257,
                "n_embd": 1600,
                "n_layer": 48,
                "n_head": 25,
                "n_positions": 1024,
                "use_cache": False,
            },
            description="openai-community/gpt2-xl (1.5B, learned positions, tied embeddings)",
            seq_len=1024,
        ),
    ]
}

#: sizes every decoder config must state, by their normalised transformers name
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
#: further sizes checked when present
OPTIONAL_SIZE_KEYS = (
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "n_inner",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "moe_intermediate_size",
)
#: what one config may ask for (docs/guide/limits.md): far above any released model (the largest
#: have ~126 layers, width 16,384 to 25,600, 262,144 tokens of vocabulary), low enough that
#: building the model on the meta device and scoring every configuration take seconds
SIZE_LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 131_072,
    "intermediate_size": 1_048_576,
    "n_inner": 1_048_576,
    "moe_intermediate_size": 1_048_576,
    "vocab_size": 4_194_304,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "max_position_embeddings": 16_777_216,
    "num_local_experts": 1024,
    "num_experts": 1024,
}
#: a config.json: read at most this many bytes, nested at most this deep (as YAML inputs)
MAX_CONFIG_BYTES = 1_000_000
MAX_CONFIG_DEPTH = 32


def _transformers_config(cfg: dict[str, Any], source: str) -> Any:
    """The transformers config object, or one clear line on what is wrong with the dict."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise UserError(f"{source} is not a causal-LM model config: missing model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), 3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(
            f"{source}: model_type '{model_type}' is not a causal LM transformers can build{hint}"
        )
    from transformers import CONFIG_MAPPING

    aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", {})  # name -> family's key
    missing = [k for k in SIZE_KEYS if k not in cfg and aliases.get(k, k) not in cfg]
    if missing:
        raise UserError(f"{source} is not a causal-LM model config: missing {', '.join(missing)}")
    for key in (*SIZE_KEYS, *OPTIONAL_SIZE_KEYS):
        raw = aliases.get(key, key)
        if raw not in cfg and key not in cfg:
            continue
        value = cfg.get(raw, cfg.get(key))
        if value is None and key not in SIZE_KEYS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{source}: {key} must be a positive integer (got {value!r})"[:300])
        limit = SIZE_LIMITS.get(key)
        if limit is not None and value > limit:
            raise UserError(
                f"{source}: {key} {value:,} is more than {limit:,}, the limit of one model "
                "config (docs/guide/limits.md)"
            )
    heads = cfg.get(aliases.get("num_attention_heads", "num_attention_heads"))
    kv = cfg.get(aliases.get("num_key_value_heads", "num_key_value_heads"))
    if isinstance(kv, int) and isinstance(heads, int) and heads % kv:
        raise UserError(
            f"{source}: num_key_value_heads {kv} does not divide num_attention_heads {heads} "
            "(each key/value head serves a whole group of query heads)"
        )
    args = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **args)
    except Exception as exc:  # transformers' own validation: strict dataclass fields and more
        text = " ".join(str(exc).split())
        raise UserError(f"{source}: invalid {model_type} config: {text}"[:300]) from None
    return config


def validate_config(cfg: dict[str, Any], source: str = "model config") -> None:
    """Raise ``UserError`` (one line) unless transformers builds a causal LM from ``cfg``."""
    if not isinstance(cfg, dict):
        raise UserError(f"{source} is not a causal-LM model config: not a JSON object")
    model_stats(json.dumps(cfg, sort_keys=True), source)


@dataclass(frozen=True)
class ModelStats:
    """What the estimators need of an architecture, read off the transformers model itself."""

    n_params: int  # unique parameters (tied embeddings once)
    shapes: tuple[tuple[int, ...], ...]  # every unique parameter's shape
    largest_module_params: int  # DeepSpeed's "largest layer": most direct params of one module
    largest_param: int  # the biggest single tensor (the optimizer's foreach temporaries)
    layer_params: int  # one decoder layer, all of it
    layer_matrix_params: int  # one decoder layer's 2-D (linear) weights, experts excluded
    expert_params: int  # one decoder layer's expert weights (0 for a dense model)
    experts: int  # experts per MoE layer (0: dense)
    top_k: int  # experts each token passes through
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # MLP width a token passes through (per expert for MoE)
    vocab: int
    gated_mlp: bool  # SwiGLU-style gate and up projections (3 matrices), else 2
    tied: bool
    model_type: str
    hidden_act: str = "silu"
    resid_dropout: float = 0.0  # dropout on each residual branch (GPT-2's resid_pdrop)
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0
    #: how the layer's norms keep their input: "rms" (llama's RMSNorm: its input and the
    #: normalised copy, scaled in the input's dtype), "rms_fp32" (Gemma's: scaled in fp32) or
    #: "layer" (``nn.LayerNorm``: the input only)
    norm: str = "rms"
    norms: int = 2  # per layer (Gemma 2 has four)
    shared_norm_input: bool = False  # parallel residual: both norms read the same tensor
    qk_norm: bool = False  # an RMSNorm on q and k (Qwen3)
    attn_softcap: bool = False  # tanh-capped attention scores (Gemma 2)
    qkv_projections: int = 3  # linear layers making q, k and v (1 when fused, as GPT-2's c_attn)
    mlp_in_projections: int = 2  # linear layers reading the MLP's input (gate and up, fused: 1)
    rotary: bool = True  # rotary position embeddings (q and k rewritten before attention)
    #: eager attention takes its softmax in fp32 and casts it back (all but GPT-2 here)
    softmax_fp32: bool = True
    #: linear weights stored (in, out): GPT-2's ``Conv1D`` (``shapes`` as stored)
    weights_in_out: bool = False
    #: (out, in) of every linear layer but the head: what QLoRA quantizes and adapts
    linear_shapes: tuple[tuple[int, int], ...] = ()

    @cached_property
    def linear_params(self) -> int:
        """Weights of the linear layers QLoRA quantizes (``linear_shapes``)."""
        return sum(out_f * in_f for out_f, in_f in self.linear_shapes)

    @property
    def active_params(self) -> int:
        """Parameters each token multiplies with (all but the unused experts)."""
        if not self.experts:
            return self.n_params
        unused = self.expert_params * (self.experts - self.top_k) // self.experts
        return self.n_params - self.layers * unused


@lru_cache(maxsize=64)
def model_stats(cfg_json: str, source: str = "model config") -> ModelStats:
    """Build the model on the meta device (free) and read its parameter shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    from trials.techniques.quantization import linear_shapes

    cfg = json.loads(cfg_json)
    config = _transformers_config(cfg, source)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # a config transformers accepts but cannot build
        raise UserError(f"{source}: transformers cannot build it: {exc}".splitlines()[0]) from None
    params = list(model.parameters())  # unique: tied weights appear once
    layer_list = next(
        (
            m
            for m in model.modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) == config.num_hidden_layers
        ),
        None,
    )
    if layer_list is None:
        raise UserError(f"{source}: no stack of {config.num_hidden_layers} decoder layers found")
    layer = layer_list[0]
    experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0)
    expert_params = sum(
        p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}" and experts
    )
    matrix = sum(
        p.numel()
        for n, p in layer.named_parameters()
        if p.dim() == 2 and not (experts and ".experts." in f".{n}")
    )
    names = " ".join(n for n, _ in layer.named_parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    inter = (
        (getattr(config, "moe_intermediate_size", None) if experts else None)
        or getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * h
    )
    return ModelStats(
        n_params=sum(p.numel() for p in params),
        shapes=tuple(tuple(p.shape) for p in params),
        largest_module_params=int(largest),
        largest_param=max(p.numel() for p in params),
        layer_params=sum(p.numel() for p in layer.parameters()),
        layer_matrix_params=int(matrix),
        expert_params=int(expert_params),
        experts=experts,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
        hidden=h,
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(inter),
        vocab=int(config.vocab_size),
        gated_mlp="gate" in names,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        model_type=str(cfg["model_type"]),
        hidden_act=str(
            getattr(config, "hidden_activation", None)
            or getattr(config, "hidden_act", None)
            or getattr(config, "activation_function", None)
            or "silu"
        ),
        resid_dropout=_rate(config, "resid_pdrop", "hidden_dropout"),
        embd_dropout=_rate(config, "embd_pdrop"),
        attn_dropout=_rate(config, "attn_pdrop", "attention_dropout"),
        **_layout(model, config, layer, h, (heads + 2 * kv_heads) * head_dim, int(inter)),
        linear_shapes=tuple(linear_shapes(model)),
    )


def _layout(
    model: Any, config: Any, layer: Any, hidden: int, qkv: int, inter: int
) -> dict[str, Any]:
    """How the layer is laid out, from its modules: what it keeps for backward depends on it
    (the norms' kind, fused projections, rotary copies; ``activations.layer_activation_bytes``)."""
    import torch

    def widths(m: Any) -> tuple[int, int] | None:  # (in, out); GPT-2's Conv1D stores (in, out)
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or isinstance(m, torch.nn.Embedding):
            return None
        rows, cols = int(w.shape[0]), int(w.shape[1])
        return (cols, rows) if isinstance(m, torch.nn.Linear) else (rows, cols)  # Conv1D: (in, out)

    reading_hidden = [wd[1] for m in layer.modules() if (wd := widths(m)) and wd[0] == hidden]
    fused_qkv = qkv in reading_hidden
    rotary = any("Rotary" in type(m).__name__ for m in model.modules())
    mlp_in = 1 if 2 * inter in reading_hidden else min(2, reading_hidden.count(inter))
    norms = [
        m
        for n, m in layer.named_modules()
        if "norm" in type(m).__name__.lower() and n.rsplit(".", 1)[-1] not in ("q_norm", "k_norm")
    ]
    if any(isinstance(m, torch.nn.LayerNorm) for m in norms):
        norm = "layer"
    elif any(type(m).__name__.startswith("Gemma") for m in norms):
        norm = "rms_fp32"
    else:
        norm = "rms"
    return {
        "norm": norm,
        "norms": len(norms) or 2,
        "shared_norm_input": bool(getattr(config, "use_parallel_residual", False)),
        "qk_norm": any(n.rsplit(".", 1)[-1] == "q_norm" for n, _ in layer.named_modules()),
        "attn_softcap": getattr(config, "attn_logit_softcapping", None) is not None,
        "qkv_projections": 1 if fused_qkv else 3,
        "mlp_in_projections": mlp_in or 2,  # 0: experts in 3-D tensors, as the gated default
        "rotary": rotary,
        "softmax_fp32": _softmax_fp32(model),
        "weights_in_out": any(type(m).__name__ == "Conv1D" for m in layer.modules()),
    }


def _softmax_fp32(model: Any) -> bool:
    """Whether the model's eager attention asks softmax for fp32 (read off its source: the
    dtype of a tensor it keeps for backward is nowhere else to be had without running it)."""
    import inspect
    import sys

    eager = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    try:
        return eager is None or "float32" in inspect.getsource(eager)
    except (OSError, TypeError):
        return True


def _rate(config: Any, *keys: str) -> float:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int | float):
            return float(value)
    return 0.0


#: id(config dict) -> (a copy of it, its stats): the estimators ask for the same dict many times
_BY_ID: dict[int, tuple[dict[str, Any], ModelStats]] = {}


def stats_of(cfg: dict[str, Any]) -> ModelStats:
    hit = _BY_ID.get(id(cfg))
    if hit is not None and hit[0] == cfg:
        return hit[1]
    st = model_stats(json.dumps(cfg, sort_keys=True))
    if len(_BY_ID) > 256:
        _BY_ID.clear()
    _BY_ID[id(cfg)] = (dict(cfg), st)
    return st


def count_params(cfg: dict[str, Any]) -> int:
    """Parameter count of the transformers model the config builds (built on the meta device)."""
    return stats_of(cfg).n_params


def _depth(value: Any) -> int:
    """How deep ``value`` nests (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
    return deepest


def _read_config_json(path: Path, shown: str) -> Any:
    """A config.json within ``MAX_CONFIG_BYTES`` and ``MAX_CONFIG_DEPTH``; one line otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UserError(f"model config {shown}: cannot read it: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UserError(f"model config {shown}: larger than {MAX_CONFIG_BYTES:,} bytes")
    try:
        cfg = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise UserError(
            f"model config {shown}: nested deeper than {MAX_CONFIG_DEPTH} levels"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"model config {shown} is not valid JSON: {exc}") from None
    if _depth(cfg) > MAX_CONFIG_DEPTH:
        raise UserError(f"model config {shown}: nested deeper than {MAX_CONFIG_DEPTH} levels")
    return cfg


def check_seq_len(seq_len: int | None, config: dict[str, Any], model: str) -> None:
    """A sequence longer than the model's position table: transformers would index past it
    (an error mid-trial on CUDA, garbage rotary positions for some models)."""
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    if seq_len is not None and isinstance(limit, int) and 0 < limit < seq_len:
        raise UserError(
            f"--seq-len {seq_len} is longer than {model}'s max_position_embeddings ({limit}); "
            f"use at most {limit}"
        )


def resolve_model(name_or_path: str) -> ModelEntry:
    """A registered name, a path to a transformers ``config.json``, or a model folder / cached
    Hub id with its pretrained weights (``autotune.model_source``; local files only)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    folder = model_folder(name_or_path)
    if folder is not None:
        entry = resolve_model(str(folder / "config.json"))
        check_weights(folder, name_or_path, entry.config)
        local = Path(name_or_path).expanduser().is_dir()
        name = Path(name_or_path).resolve().name if local else name_or_path
        return replace(entry, name=name, description=str(folder), weights=str(folder))
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise UserError(f"model config file not found: {name_or_path}")
        cfg = _read_config_json(path, name_or_path)
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise UserError(f"{name_or_path} is not a causal-LM model config: missing model_type")
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "architectures"}
        cfg.pop("torch_dtype", None)
        cfg.pop("dtype", None)
        cfg.setdefault("use_cache", False)
        validate_config(cfg, name_or_path)
        seq = min(
            2048, int(_transformers_config(cfg, name_or_path).max_position_embeddings or 2048)
        )
        return ModelEntry(
            name=path.stem, config=cfg, seq_len=seq, global_batch_size=16, description=str(path)
        )
    close = difflib.get_close_matches(name_or_path, list(MODELS), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"unknown model '{name_or_path}'{hint} (known: {', '.join(MODELS)})")
