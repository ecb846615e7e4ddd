"""ZeRO through the real DeepSpeed engine: the one config builder, and the offload bookkeeping.

``deepspeed_config`` is the single place a DeepSpeed JSON is made: the trial job passes its result
to ``deepspeed.initialize`` and ``autotune export --format deepspeed`` writes the same dict, so
the exported file is exactly what the trial ran.

Choices that keep a ZeRO trial exact against the plain PyTorch trial of the same config:

* ``optimizer.params.torch_adam = true`` without offload (``trials.techniques.optimizer``):
  DeepSpeed then builds ``torch.optim.AdamW`` itself (the reference's optimizer), instead of
  its fused CUDA Adam.
* With ``offload_optimizer: cpu`` DeepSpeed insists on ``DeepSpeedCPUAdam`` (a C++/AVX build of
  the same AdamW update); its losses agree with torch's AdamW to ~1e-6 relative (see README).
* ``gradient_clipping: 0`` because the plain trial does not clip.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch

from trials.techniques import TECHNIQUES
from trials.techniques.base import Config, Run, merge
from trials.techniques.offload import offloads_optimizer, offloads_params, param_offload


def deepspeed_config(config: Config, run: Run) -> dict[str, Any]:
    """The DeepSpeed JSON for a trial config (also what ``autotune export`` writes): the trial's
    semantics (no clipping, no console output) and every registered technique's ``deepspeed``
    part (batch shape, precision, ZeRO stage, offload, buckets, optimizer), merged key by key."""
    ds: dict[str, Any] = {
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    for technique in TECHNIQUES:
        merge(ds, technique.deepspeed(config, run))
    return ds


# --- one process (or torchrun's N) as a DeepSpeed world ------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_distributed(backend: str, deepspeed_comm: bool) -> None:
    """Join (or, alone, make) the process group: gloo on CPU, nccl on CUDA.

    torchrun sets RANK/WORLD_SIZE/MASTER_*; a single job sets them itself, on a free port.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist_backend = "nccl" if backend == "cuda" else "gloo"
    if deepspeed_comm:
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist_backend, verbose=False)
    else:
        torch.distributed.init_process_group(dist_backend)


# --- what lives on the host when offloaded --------------------------------------------------------


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


#: DeepSpeed ZeRO optimizer attributes that hold host buffers under ``offload_optimizer``
#: (fp32 master partitions and their gradients; stage 1/2 and stage 3 name them differently).
#: Stage 1/2 also stage the 16-bit partition and each gradient in host memory
#: (``param_buffer_of_bit16_for_cpu_offload_groups``, ``temp_grad_buffer_for_cpu_offload``:
#: ``DeepSpeedZeroOptimizer.__init__`` makes both on ``self.device``, the CPU under offload, in
#: deepspeed/runtime/zero/stage_1_and_2.py); its ``temp_grad_buffer_for_gpu_offload`` is on the
#: device and stays counted there.
_OFFLOADED_OPTIMIZER_ATTRS = (
    "single_partition_of_fp32_groups",
    "accumulated_grads_in_cpu",
    "fp32_partitioned_groups_flat",
    "grad_partitions_flat_buffer",
    "param_buffer_of_bit16_for_cpu_offload_groups",
    "temp_grad_buffer_for_cpu_offload",
)
#: ... and under ``offload_param`` (stage 3's 16-bit partitions)
_OFFLOADED_PARAM_ATTRS = ("fp16_partitioned_groups_flat", "param_groups_fp16_flat_cpu_memory")


def offloaded_tensors(
    zero_optimizer: Any, model: torch.nn.Module, config: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors DeepSpeed keeps in host memory for this config (empty without offload).

    On a GPU these are plainly CPU tensors; on the CPU backend every tensor is a CPU tensor, so
    the memory monitor is told which of them are the host side (see ``CpuMemoryMonitor``).
    """
    out: list[torch.Tensor] = []
    if offloads_optimizer(config):
        for attr in _OFFLOADED_OPTIMIZER_ATTRS:
            out += _tensors(getattr(zero_optimizer, attr, None))
        inner = getattr(zero_optimizer, "optimizer", None)
        if inner is not None:
            out += _tensors(list(inner.state.values()))
    if offloads_params(config):
        for attr in _OFFLOADED_PARAM_ATTRS:
            out += _tensors(getattr(zero_optimizer, attr, None))
        partitions = (getattr(p, "ds_tensor", None) for p in model.parameters())
        out += [t for t in partitions if t is not None]
    return out


def device_buffers(zero_optimizer: Any) -> list[torch.Tensor]:
    """Device buffers DeepSpeed makes inside ``deepspeed.initialize``: with ``offload_param`` the
    trial job counts everything made there as host memory (``host_allocations``), so these are
    handed back to the device count: stage 3's IPG bucket (``reduce_bucket_size`` elements, made
    on the accelerator by ``_setup_for_real_optimizer``, deepspeed/runtime/zero/stage3.py)."""
    buckets = getattr(zero_optimizer, "ipg_buckets", None) or {}
    out = []
    for bucket in buckets.values():
        buffer = getattr(bucket, "buffer", None)
        if isinstance(buffer, torch.Tensor):
            out.append(buffer)
    return out


# --- building a ZeRO-3 model partitioned from the start -------------------------------------------


@contextlib.contextmanager
def zero3_init(ds_config: dict[str, Any], host_allocations: Any) -> Iterator[None]:
    """``deepspeed.zero.Init`` for this config: each module's parameters are partitioned (and,
    with ``offload_param``, put in host memory) as soon as the module is made, so the whole
    model never exists on the device. ``host_allocations`` (the memory monitor's) is the context
    in which DeepSpeed makes the offloaded partitions: on the CPU backend they are host memory
    from birth. transformers' ``prevent_arange_dtype_change`` keeps RoPE's buffers exact in
    16-bit configs, as in its own ZeRO-3 path (``PreTrainedModel._from_config``)."""
    import deepspeed
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    offload = param_offload(ds_config)

    class _Init(deepspeed.zero.Init):  # type: ignore[misc]
        # ``_post_init_method`` is the hook DeepSpeed's Init overrides to partition a module
        def _post_init_method(self, module: torch.nn.Module) -> None:
            with host_allocations() if offload else contextlib.nullcontext():
                super()._post_init_method(module)

    with (
        prevent_arange_dtype_change(),
        _Init(
            config_dict_or_path=ds_config,
            remote_device="cpu" if offload else None,
            pin_memory=bool(offload and offload.get("pin_memory")),
        ),
    ):
        yield


def gathered(params: list[torch.nn.Parameter]) -> Any:
    """The parameters whole for the duration (rank 0's values are kept): ZeRO-3's init."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


# --- what each of DeepSpeed's buffers is, for the memory breakdown --------------------------------

#: ZeRO optimizer attributes by role (stage 1/2 and stage 3 names); a master partition's ``.grad``
#: is a gradient, the partition itself an optimizer state (the ZeRO paper's 4 + K bytes/param)
_ROLE_ATTRS: dict[str, tuple[str, ...]] = {
    "parameters": ("bit16_groups_flat", "fp16_partitioned_groups_flat"),
    "gradients": (
        "averaged_gradients",
        "ipg_buffer",
        "grad_partitions_flat_buffer",
        "accumulated_grads_in_cpu",
    ),
    "optimizer_states": ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"),
}


def zero_roles(zero_optimizer: Any, model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The tensors DeepSpeed holds for this model, by role (``trials.roles.ROLES``)."""
    params = list(model.parameters())
    roles: dict[str, list[torch.Tensor]] = {
        "parameters": params
        + [t for p in params if (t := getattr(p, "ds_tensor", None)) is not None],
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer_states": [],
    }
    for role, attrs in _ROLE_ATTRS.items():
        for attr in attrs:
            found = list(_tensors(getattr(zero_optimizer, attr, None)))
            if role == "optimizer_states":  # the partitions' .grad are gradients
                roles["gradients"] += [t.grad for t in found if t.grad is not None]
            roles[role] += found
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    roles["optimizer_states"] += list(_tensors(list(getattr(inner, "state", {}).values())))
    return roles
