"""What this machine can run, detected once, never assumed; injectable for tests.

The techniques' requirements (``trials.techniques``: each choice's ``Knob.requires``) are checks
on these facts; ``autotune.availability`` applies them to a search space.
"""

from __future__ import annotations

import importlib.util
import shutil
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
    has_torchao: bool = False  # torchao's low-bit optimizers

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
            has_torchao=importlib.util.find_spec("torchao") is not None,
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


def needs_cuda(hw: Hardware) -> str | None:
    return None if hw.backend == "cuda" else "needs a CUDA GPU"


def needs_torchao(hw: Hardware) -> str | None:
    """torchao's 8-/4-bit AdamW: any device (on a CPU its compiled step runs eagerly)."""
    return None if hw.has_torchao else "torchao is not installed (pip install 'autotune[gpu]')"


def needs_bitsandbytes(hw: Hardware) -> str | None:
    """bitsandbytes (8-bit optimizers, int8/nf4 weights) runs on CUDA only."""
    if hw.backend != "cuda":
        return "bitsandbytes needs a CUDA GPU"
    if not hw.has_bitsandbytes:
        return "bitsandbytes is not installed (pip install 'autotune[gpu]')"
    return None
