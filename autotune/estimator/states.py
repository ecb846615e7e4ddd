"""Model-state bytes per GPU (parameters, gradients, optimizer states) for every precision x
optimizer x ZeRO stage x offload x quantization, from the parameter shapes of the config.

Accounting (Psi parameters, N GPUs, K optimizer-state bytes per parameter):

* ZeRO stage 0 is the trial job's own loop (torch autocast over fp32 weights): 4 Psi weights,
  4 Psi gradients, K Psi states, nothing sharded (data parallel replicates them).
* ZeRO 1-3 is DeepSpeed's engine: in 16-bit, 2 Psi weights + 2 Psi gradients + (4 + K) Psi of
  fp32 master weights and states (the ZeRO paper's 2 + 2 + 12); in fp32 4 + 4 + K. Stage 1
  shards the optimizer part over N, stage 2 also the gradients (DeepSpeed keeps an fp32 gradient
  partition too: its ``estimate_zero2`` 2 Psi + 18 Psi/N), stage 3 everything (18 Psi/N, as
  ``estimate_zero3``), plus the gathered working set (largest layer and the prefetch bucket).
* ``offload_optimizer: cpu`` keeps master weights and states in host memory;
  ``offload_param: cpu`` (stage 3) keeps the parameter shards there too.
* ``quantization`` int8/nf4: frozen base linear weights at 1 / 0.5 B (+ scales), other weights
  frozen in fp32, LoRA adapters (rank ``lora_r``, default 8, on every linear of every layer)
  trained in fp32 with the chosen optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trials.techniques import OPTIMIZERS

Shape = tuple[int, ...]

#: bytes per base weight when quantized, as trials/quantization.py builds them (bitsandbytes:
#: int8 with a row-wise fp32 scale; nf4 in blocks of 64 with an fp32 absmax, no double quant)
QUANT_BYTES = {"int8": 1.0 + 4 / 4096, "nf4": (4 + 32 / 64) / 8}
DEFAULT_LORA_R = 8  # trials.quantization.LORA_RANK
DS_PREFETCH_PARAMS = 50_000_000  # DeepSpeed stage3_prefetch_bucket_size default


def layer_linear_shapes(cfg: dict[str, Any]) -> list[Shape]:
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg.get("intermediate_size") or 4 * h)
    return [
        (heads * d, h),  # q
        (kv * d, h),  # k
        (kv * d, h),  # v
        (h, heads * d),  # o
        (inter, h),  # gate
        (inter, h),  # up
        (h, inter),  # down
    ]


def param_shapes(cfg: dict[str, Any]) -> list[Shape]:
    """Every parameter's shape for a LLaMA-style decoder (Llama, Mistral, Qwen2-like)."""
    h, v = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    layer = [*layer_linear_shapes(cfg), (h,), (h,)]
    shapes: list[Shape] = [(v, h)]
    for _ in range(int(cfg["num_hidden_layers"])):
        shapes.extend(layer)
    shapes.append((h,))
    if not cfg.get("tie_word_embeddings"):
        shapes.append((v, h))
    return shapes


def numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def optimizer_state_bytes(name: str, shapes: list[Shape]) -> int:
    """fp32 state bytes of the optimizer for these parameters (step counters ignored)."""
    if name == "adafactor":  # factored second moment: a row and a column vector per matrix
        return sum(4 * (s[0] + s[1]) if len(s) == 2 else 4 * numel(s) for s in shapes)
    if name == "adamw_8bit":  # bitsandbytes: 8-bit states from 4096 values, fp32 below
        return sum(
            2 * numel(s) + 8 * ((numel(s) + 255) // 256) if numel(s) >= 4096 else 8 * numel(s)
            for s in shapes
        )
    return int(OPTIMIZERS[name].state_bytes_per_param * sum(numel(s) for s in shapes))


def uses_deepspeed(config: dict[str, Any]) -> bool:
    return bool(config.get("deepspeed")) or int(config.get("zero_stage", 0) or 0) > 0


@dataclass
class ModelStates:
    parts: dict[str, int]  # parameters, gradients, optimizer_states (per GPU)
    extra: int = 0  # gathered working set etc. (temporaries)
    replaces_trace: bool = False  # the single-process trace can't see this accounting
    frozen_copies: int = 0  # 16-bit copies autocast made in the trace of weights now frozen
    notes: list[str] = field(default_factory=list)


def model_states(model_cfg: dict[str, Any], config: dict[str, Any], nproc: int) -> ModelStates:
    shapes = param_shapes(model_cfg)
    n_params = sum(numel(s) for s in shapes)
    n = max(1, int(nproc))
    opt = str(config.get("optimizer", "adamw"))
    precision = str(config.get("precision", "fp32"))
    stage = int(config.get("zero_stage", 0) or 0)
    off_opt = config.get("offload_optimizer", "none") == "cpu"
    off_param = config.get("offload_param", "none") == "cpu"
    quant = str(config.get("quantization", "none") or "none")
    notes: list[str] = []

    if quant != "none":
        r = int(config.get("lora_r", DEFAULT_LORA_R))
        linear = layer_linear_shapes(model_cfg) * int(model_cfg["num_hidden_layers"])
        quantized = sum(numel(s) for s in linear)
        lora_shapes: list[Shape] = []
        for out_f, in_f in linear:
            lora_shapes += [(r, in_f), (out_f, r)]
        lora = sum(numel(s) for s in lora_shapes)
        # embeddings, norms and the head stay frozen in fp32, as the trial job builds them
        frozen = int(quantized * QUANT_BYTES[quant]) + 4 * (n_params - quantized)
        notes.append(f"{quant} base weights + LoRA r={r} ({lora / 1e6:.1f}M trainable) by formula")
        return ModelStates(
            {
                "parameters": frozen + 4 * lora,
                "gradients": 4 * lora,
                "optimizer_states": optimizer_state_bytes(opt, lora_shapes),
            },
            replaces_trace=True,
            frozen_copies=2 * quantized if precision in ("bf16", "fp16") else 0,
            notes=notes,
        )

    states = optimizer_state_bytes(opt, shapes)
    if stage == 0:
        return ModelStates(
            {"parameters": 4 * n_params, "gradients": 4 * n_params, "optimizer_states": states}
        )

    half = precision in ("bf16", "fp16")
    wbytes = 2 if half else 4
    weights, grads = wbytes * n_params, wbytes * n_params
    optim = states + (4 * n_params if half else 0)  # fp32 master copy in mixed precision
    fp32_grad_partition = 4 * n_params if (half and stage >= 2) else 0
    extra = 0
    if stage >= 1:
        optim //= n
    if stage == 2:
        grads = (grads + fp32_grad_partition) // n
    if stage >= 3:  # 16-bit gradients only pass through reduce-scatter buckets
        grads = (fp32_grad_partition or grads) // n
        weights //= n
        largest = max(sum(numel(s) for s in layer_linear_shapes(model_cfg)), numel(shapes[0]))
        extra = wbytes * (largest + DS_PREFETCH_PARAMS)
    if off_opt:
        optim = 0
        notes.append("optimizer states and fp32 master weights offloaded to CPU memory")
    if off_param and stage >= 3:
        weights = 0
        notes.append("parameter shards offloaded to CPU memory")
    notes.append(f"model states: ZeRO-{stage} over {n} GPU(s) by formula")
    return ModelStates(
        {"parameters": weights, "gradients": grads, "optimizer_states": optim},
        extra=extra,
        replaces_trace=True,
        notes=notes,
    )
