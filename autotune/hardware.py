"""What this machine can run, detected once, never assumed; injectable for tests."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    backend: str  # "cpu" or "cuda"
    cuda_capability: tuple[int, int] | None = None
    gpu_count: int = 0
    has_flash_attn: bool = False
    has_bitsandbytes: bool = False
    has_peft: bool = False
    has_deepspeed: bool = True  # a dependency of the project; detect() still checks
    has_cxx: bool = True  # a C++ compiler builds DeepSpeedCPUAdam (once; cached)
    cpu_fp16: bool = False  # oneDNN fp16 kernels: DeepSpeed refuses fp16 on a CPU without them

    @classmethod
    def detect(cls, backend: str | None = None) -> Hardware:
        import torch

        cuda = torch.cuda.is_available()
        return cls(
            backend=backend or ("cuda" if cuda else "cpu"),
            cuda_capability=torch.cuda.get_device_capability(0) if cuda else None,
            gpu_count=torch.cuda.device_count() if cuda else 0,
            has_flash_attn=importlib.util.find_spec("flash_attn") is not None,
            has_bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None,
            has_peft=importlib.util.find_spec("peft") is not None,
            has_deepspeed=importlib.util.find_spec("deepspeed") is not None,
            has_cxx=any(shutil.which(c) for c in ("c++", "g++", "clang++")),
            cpu_fp16=_cpu_fp16(),
        )

    @property
    def ampere_or_newer(self) -> bool:
        return self.cuda_capability is not None and self.cuda_capability >= (8, 0)


def _cpu_fp16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _needs_cuda(hw: Hardware) -> str | None:
    return None if hw.backend == "cuda" else "needs a CUDA GPU"


def _flash_attn(hw: Hardware) -> str | None:
    if hw.backend != "cuda":
        return "needs a CUDA GPU"
    if not hw.ampere_or_newer:
        return f"needs SM80+ (this GPU is SM{''.join(map(str, hw.cuda_capability or ()))})"
    if not hw.has_flash_attn:
        return "flash_attn is not installed (pip install 'autotune[gpu]')"
    return None


def _bf16(hw: Hardware) -> str | None:
    if hw.backend == "cuda" and not hw.ampere_or_newer:
        return "bf16 needs an Ampere (SM80) or newer GPU"
    return None


def _bnb(hw: Hardware) -> str | None:
    if hw.backend != "cuda":
        return "bitsandbytes needs a CUDA GPU"
    if not hw.has_bitsandbytes:
        return "bitsandbytes is not installed (pip install 'autotune[gpu]')"
    return None


def _quantized(hw: Hardware) -> str | None:
    reason = _bnb(hw)
    if reason is None and not hw.has_peft:
        return "peft is not installed"
    return reason


def _cpu_adam(hw: Hardware) -> str | None:
    """ZeRO-Offload runs DeepSpeedCPUAdam, a C++ extension built on first use."""
    if not hw.has_deepspeed:
        return "deepspeed is not installed"
    if not hw.has_cxx:
        return "DeepSpeedCPUAdam needs a C++ compiler to build (apt-get install g++)"
    return None


def _deepspeed_fp16(hw: Hardware) -> str | None:
    if hw.backend == "cpu" and not hw.cpu_fp16:
        return "DeepSpeed has no fp16 on this CPU (no oneDNN fp16 kernels)"
    return None


#: (dimension, choice) -> check returning why it can't run here, or None when it can.
REQUIREMENTS: dict[tuple[str, object], Callable[[Hardware], str | None]] = {
    ("attention", "flash_attention_2"): _flash_attn,
    ("precision", "bf16"): _bf16,
    ("optimizer", "adamw_8bit"): _bnb,
    ("quantization", "int8"): _quantized,
    ("quantization", "nf4"): _quantized,
    ("offload_optimizer", "cpu"): _cpu_adam,
    ("offload_param", "cpu"): _cpu_adam,
}

#: (dimension, choice) -> (another dimension, check): the check applies when the space has that
#: dimension too (fp16 is fine in plain torch on any CPU, but every zero_stage runs DeepSpeed).
REQUIREMENTS_WITH: dict[tuple[str, object], tuple[str, Callable[[Hardware], str | None]]] = {
    ("precision", "fp16"): ("zero_stage", _deepspeed_fp16),
}


#: dimension -> check: the whole dimension is dropped where it means nothing (an allocator
#: setting of CUDA's on a CPU), with one line, instead of leaving a one-choice dimension
DIMENSION_REQUIREMENTS: dict[str, Callable[[Hardware], str | None]] = {
    "expandable_segments": _needs_cuda,
}


def dimension_unavailable_reason(hw: Hardware, dimension: str) -> str | None:
    check = DIMENSION_REQUIREMENTS.get(dimension)
    return check(hw) if check else None


def unavailable_reason(
    hw: Hardware, dimension: str, choice: object, space_dimensions: Collection[str] = ()
) -> str | None:
    check = REQUIREMENTS.get((dimension, choice))
    reason = check(hw) if check else None
    other, check_with = REQUIREMENTS_WITH.get((dimension, choice), ("", None))
    if reason is None and check_with is not None and other in space_dimensions:
        reason = check_with(hw)
    return reason


def gpu_key_for(device_name: str, memory_bytes: int) -> str | None:
    """The estimator's spec (``autotune.estimator.gpus``) for a CUDA device, from the name
    ``torch.cuda.get_device_name`` reports and its memory: the known card whose model name is
    in the device's name (``NVIDIA H100 80GB HBM3`` -> ``h100``), of the closest memory size;
    None for a card the table does not know (the prior then stays nominal)."""
    import re

    from autotune.estimator.gpus import GPUS

    def words(text: str) -> list[str]:
        return re.findall(r"[a-z]+\d+[a-z]*|\d+[a-z]*", text.lower())

    name = device_name.lower()
    matches = [
        g
        for g in GPUS.values()
        if (model := next((w for w in words(g.name) if any(c.isdigit() for c in w)), None))
        and re.search(rf"\b{re.escape(model)}\b", name)
    ]
    if not matches:
        return None
    return min(matches, key=lambda g: abs(g.memory_bytes - memory_bytes)).key


def detected_gpu_key(device: int = 0) -> str | None:
    """``gpu_key_for`` this machine's CUDA device (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return gpu_key_for(props.name, int(props.total_memory))
