"""Paged optimizer states: what stays on the device, what lives in host memory, what crosses PCIe.

bitsandbytes' paged optimizers (``PagedAdamW8bit`` and its siblings) allocate the states of every
tensor of at least 100,000 values in CUDA unified memory (``Optimizer8bit.get_state_buffer``:
``F.get_paged``, backed by ``cudaMallocManaged`` through ``cget_managed_ptr``); smaller tensors'
states are ordinary device tensors. Before each paged tensor's update the optimizer prefetches
its states to the GPU (``prefetch_state``: ``cudaMemPrefetchAsync``) and synchronises after it
(``sync_gpu``). Managed pages are not the caching allocator's: the driver evicts them to host
memory when a ``cudaMalloc`` needs the room, and brings them back on the next prefetch.

The model, for a device budget ``B`` and a peak ``P`` counted with every state resident:

* the states that do not fit, ``spill = min(P - B, paged)``, live in host memory; the device
  holds ``P - spill`` at its peak; the configuration fits when ``P - paged <= B``;
* each step the spilled bytes come back for their updates (host to device) while as many are
  evicted to make the room (device to host, for the activations of the next forward): both
  directions at once on a full-duplex link, ``spill / PCIe`` per step, not overlapped (the
  optimizer synchronises after every paged tensor);
* the caching allocator's own peak (what ``torch.cuda.max_memory_allocated`` reports, the
  figure published runs quote) leaves the paged states out: ``P - paged``.

Published check (torchtune's README, Llama 3.1 8B full fine-tune on one RTX 4090, paged 8-bit
AdamW): 18.9 GiB of allocator peak, 15 GiB of paged states of which about 10 GiB cannot stay on
a 24 GiB card, 1,650 tokens/s: a step of 2.5 s of which the recomputed forward and backward take
at least 1.6 s at the card's peak; moving every state both ways each step (30 GiB, 1.25 s over
PCIe 4) would need 100% of the peak, one way each (the model: 0.4 s) leaves a plausible 77%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.estimator.base import Estimate
from autotune.estimator.gpus import GB, GpuSpec
from autotune.estimator.speed import PCIE_EFFICIENCY
from autotune.estimator.workload import Workload
from autotune.models import stats_of
from trials.techniques import OPTIMIZERS
from trials.techniques.adapter import adapts
from trials.techniques.optimizer import optimizer_of
from trials.techniques.quantization import quantizes

#: the optimizers whose states are paged (bitsandbytes' ``Paged*`` classes)
PAGED_OPTIMIZERS = ("paged_adamw_8bit",)
#: tensors below this many values keep ordinary device states (``get_state_buffer``)
PAGED_MIN_NUMEL = 100_000


def pages(config: dict[str, Any]) -> bool:
    return optimizer_of(config) in PAGED_OPTIMIZERS


def paged_state_bytes(model_config: dict[str, Any], config: dict[str, Any]) -> int:
    """Bytes of the optimizer states bitsandbytes puts in unified memory (0 when the optimizer is
    not paged or the base is frozen: adapters' tensors are small)."""
    if not pages(config):
        return 0
    if quantizes(config) or adapts(config):  # a frozen base
        return 0
    st = stats_of(model_config)
    big = [s for s in st.shapes if _numel(s) >= PAGED_MIN_NUMEL]
    return OPTIMIZERS[optimizer_of(config)].state_bytes(big)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Paging:
    peak: int  # the device's peak, spilled states apart
    allocator_peak: int  # the caching allocator's peak: no paged state in it
    paged: int  # paged state bytes
    on_host: int  # the spilled states, in host memory; also migrated each way per step
    fits: bool  # whether paging brings the peak within the budget

    def seconds(self, gpu: GpuSpec) -> float:
        """The step's migration time: ``on_host`` each way at once over the host link."""
        return self.on_host / (gpu.pcie_gbps * GB * PCIE_EFFICIENCY)


def page(peak: int, paged: int, budget: int) -> Paging:
    """Where a peak of ``peak`` bytes (every state resident) stands under a ``budget``."""
    spill = max(0, peak - budget)
    on_host = min(spill, paged)
    return Paging(peak - on_host, peak - paged, paged, on_host, spill <= paged)


def apply_budget(
    est: Estimate, workload: Workload, config: dict[str, Any], budget: int
) -> Paging | None:
    """Rewrite an estimate of ``workload`` made with every state resident for a paged optimizer
    under ``budget``: its peak, the host memory of the spilled states and the step's migration
    time. None when the optimizer is not paged."""
    paged = paged_state_bytes(workload.model_config, config)
    if not paged:
        return None
    p = page(est.peak_bytes, paged, budget)
    if not p.on_host:
        return p
    est.peak_bytes = p.peak
    if "optimizer_states" in est.breakdown:
        est.breakdown["optimizer_states"] = max(0, est.breakdown["optimizer_states"] - p.on_host)
    est.host_breakdown["offloaded states"] = (
        est.host_breakdown.get("offloaded states", 0) + p.on_host
    )
    est.notes.append(
        f"paged optimizer states: {p.on_host / 2**30:.1f} GiB of {p.paged / 2**30:.1f} GiB in host"
        " memory, migrated each step"
    )
    gpu = workload.device
    if gpu is not None and est.step_time_s > 0:
        extra = p.seconds(gpu)
        est.tokens_per_s *= est.step_time_s / (est.step_time_s + extra)
        est.step_time_s += extra
        est.time_breakdown["paging"] = est.time_breakdown.get("paging", 0.0) + extra
    return p
