"""ZeRO-Offload: the optimizer step (stage >= 1) and the parameters (stage 3) in host memory,
DeepSpeedCPUAdam updating there; exact (its AdamW agrees with torch's to ~1e-6 relative)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Forbid, Knob, Run, Technique, When
from trials.techniques.zero import zero_stage

if TYPE_CHECKING:
    from trials.hardware import Hardware
    from trials.techniques.terms import SpeedStep

#: host memory bandwidth CPU-Adam reaches on a training server (DDR4/5, several channels)
HOST_MEMORY_GBPS = 100.0
CPU_ADAM_BYTES = 30  # fp32 p, g, m, v read; p, m, v and the 16-bit copy written


def offloads_optimizer(config: Config) -> bool:
    return zero_stage(config) >= 1 and config.get("offload_optimizer") == "cpu"


def offloads_params(config: Config) -> bool:
    return zero_stage(config) == 3 and config.get("offload_param") == "cpu"


def _cpu_adam(hw: Hardware) -> str | None:
    """ZeRO-Offload runs DeepSpeedCPUAdam, a C++ extension built on first use."""
    if not hw.has_deepspeed:
        return "deepspeed is not installed"
    if not hw.has_cxx:
        return "DeepSpeedCPUAdam needs a C++ compiler to build (apt-get install g++)"
    return None


def _host_first(v: Any) -> float:
    return {"cpu": 0.0, "none": 1.0}[v]  # offloaded, less on the device


def _offloaded(v: Any) -> tuple[int, int]:
    return 0, int(v != "none")


def param_offload(ds_config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The section of a DeepSpeed JSON (``Offload.deepspeed``'s part of it) that keeps ZeRO-3's
    parameters in host memory; None when they stay on the device."""
    section: Mapping[str, Any] | None = ds_config.get("zero_optimization", {}).get("offload_param")
    return section


class Offload(Technique):
    family = "offload"
    untraced = ("offload_optimizer", "offload_param")  # by formula beside the trace
    knobs = (
        Knob(
            "offload_optimizer",
            ("none", "cpu"),
            baseline="none",
            memory_order=_host_first,
            complexity=_offloaded,
            requires={"cpu": _cpu_adam},
            short=lambda v: "" if v == "none" else "off-opt",
        ),
        Knob(
            "offload_param",
            ("none", "cpu"),
            baseline="none",
            memory_order=_host_first,
            complexity=_offloaded,
            requires={"cpu": _cpu_adam},
            short=lambda v: "" if v == "none" else "off-param",
        ),
    )
    whens = (
        When(
            "offload_optimizer",
            {"zero_stage": (1, 2, 3)},
            "DeepSpeed offloads the optimizer's partition under ZeRO 1-3",
        ),
        When("offload_param", {"zero_stage": 3}, "only ZeRO-3 partitions the parameters"),
    )
    forbids = (
        Forbid(
            {
                "optimizer": (
                    "adafactor",
                    "lion",
                    "adamw_8bit",
                    "paged_adamw_8bit",
                    "adamw_torchao_8bit",
                    "adamw_torchao_4bit",
                ),
                "offload_optimizer": "cpu",
            },
            "DeepSpeed's offload runs its own CPU Adam (DeepSpeedCPUAdam): no other optimizer",
        ),
    )

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        pin = run.device == "cuda"  # pinned host buffers speed up GPU<->CPU copies; moot on a CPU
        zero: dict[str, Any] = {}
        if offloads_optimizer(config):
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if offloads_params(config):
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        return {"zero_optimization": zero} if zero else {}

    def operators(self, step: SpeedStep) -> None:
        if offloads_optimizer(step.config):  # the host steps (its seconds: ``speed``)
            step.optimizer_on_device = False

    def speed(self, step: SpeedStep) -> None:
        # offloaded optimizer: 16-bit gradients to the host over PCIe, copied out in the
        # reduction hooks on the compute stream every micro-batch (``stage_1_and_2.py``:
        # ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), after the first the host's fp32
        # sums up and back to be added on the GPU (stage 3 adds each micro-batch's on the
        # host), the CPU-Adam step bounded by the host's memory bandwidth (which the GPUs of a
        # host share), the updated weights back up; offloaded parameters come up over PCIe
        # in forward and backward, prefetched
        shard = step.stats.n_params / step.nproc
        if offloads_optimizer(step.config):
            step.offload += step.accum * (step.wbytes * shard / step.pcie)
            if zero_stage(step.config) < 3:
                step.offload += (step.accum - 1) * 2 * 4 * shard / step.pcie
            step.offload += CPU_ADAM_BYTES * shard / (HOST_MEMORY_GBPS * 1e9)
            step.offload += step.wbytes * shard / step.pcie
        if offloads_params(step.config):
            fetch = step.wbytes * shard / step.pcie
            step.comm_micro_exposed += max(0.0, fetch - step.fwd_all) + max(0.0, fetch - step.bwd)


TECHNIQUE = Offload()
