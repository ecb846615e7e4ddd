"""What this machine can run, detected once, never assumed; injectable for tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    backend: str  # "cpu" or "cuda"
    cuda_capability: tuple[int, int] | None = None
    gpu_count: int = 0
    has_flash_attn: bool = False
    has_bitsandbytes: bool = False
    has_peft: bool = False

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
        )

    @property
    def ampere_or_newer(self) -> bool:
        return self.cuda_capability is not None and self.cuda_capability >= (8, 0)


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


#: (dimension, choice) -> check returning why it can't run here, or None when it can.
REQUIREMENTS: dict[tuple[str, object], Callable[[Hardware], str | None]] = {
    ("attention", "flash_attention_2"): _flash_attn,
    ("precision", "bf16"): _bf16,
    ("optimizer", "adamw_8bit"): _bnb,
    ("quantization", "int8"): _quantized,
    ("quantization", "nf4"): _quantized,
}


def unavailable_reason(hw: Hardware, dimension: str, choice: object) -> str | None:
    check = REQUIREMENTS.get((dimension, choice))
    return check(hw) if check else None
