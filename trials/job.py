"""The job one trial runs: ``python -m trials.job SPEC.json RESULT.json``.

It builds the model from its config (random init, fixed seed; or the spec's pretrained weights,
``trials.weights``) the way its engine trains it
(``trials.build``: construction never above steady state), applies each technique of the trial
config for real, runs warm-up steps (memory tracked, budget enforced) and measured steps (timed
end to end, optimizer step included), and writes a ``TrialResult`` with the construction and the
training peak apart. An out-of-memory error (the allocator's, or one raised outside it:
``trials.cuda.is_oom_error``) is a result (``oom``), not a crash; any other exception is
``failed`` with its text. In a multi-process trial a rank that runs out of memory or fails
writes its result and exits at once, so torchrun stops the other ranks within seconds.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trials.build import build_model
from trials.cuda import ALLOC_CONF_ENV, capped, is_oom_error, measured_tokens
from trials.data import Batch, Documents, step_batches
from trials.engines import ENGINES, engine_for, world
from trials.extensions import clear_stale_locks
from trials.lifeline import start_lifeline
from trials.memory import MemoryMonitor, make_monitor
from trials.spec import TrialResult, TrialSpec, rank_result_path
from trials.techniques import TECHNIQUES
from trials.techniques.attention import attn_implementation
from trials.techniques.compile import compiles
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.packing import packs
from trials.techniques.quantization import builds_on_host
from trials.user_data import dataset_documents

__all__ = ["RANK_FAILED_EXIT", "build_model", "main", "rank_batches", "run_trial"]

#: exit code of a rank that ran out of memory or failed in a multi-process trial
RANK_FAILED_EXIT = 17


def rank_batches(spec: TrialSpec, step: int, rank: int, world: int) -> list[Batch]:
    """This rank's micro-batches of step ``step``: the same data, split across ranks, whatever
    N; padded or packed as the config says (``trials.data``)."""
    micro, accum = micro_and_accumulation(spec.config, spec.global_batch_size)
    documents = Documents.of(spec.documents, spec.seed)
    if spec.data:  # the user's dataset: its documents' tokens, from the controller's file
        timed = (spec.warmup_steps, spec.measured_steps)
        documents = dataset_documents(spec.data, spec.seed, 0, timed, with_tokens=True)
    return step_batches(
        step,
        micro,
        accum,
        spec.seq_len,
        int(spec.model_config["vocab_size"]),
        spec.seed,
        documents,
        packs(spec.config),
        rank,
        world,
    )


def _on(batches: list[Batch], device: torch.device) -> list[Batch]:
    return [b.to(device) for b in batches]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_statistics(times: list[float]) -> tuple[float, float]:
    """(median step time, interquartile range / median) of the measured steps."""
    if not times:
        return 0.0, 0.0
    median = statistics.median(times)
    if len(times) < 2 or median <= 0:
        return median, 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return median, (q3 - q1) / median


def build(spec: TrialSpec, device: torch.device, monitor: MemoryMonitor) -> nn.Module:
    """The model as its engine trains it; quantized runs build on the host and reach the device
    quantized (``trials.techniques.quantization``), so no full-precision copy is ever on the
    device."""
    if builds_on_host(spec.config):
        with monitor.host_allocations(), torch.device("cpu"):
            attention = attn_implementation(spec.config)
            return build_model(spec.model_config, attention, spec.seed, weights=spec.weights)
    return ENGINES[engine_for(spec.config)].build(spec, device, monitor)


def _with_host(breakdown: dict[str, int], monitor: MemoryMonitor) -> dict[str, int]:
    """The device's roles, and beside them ``host_offloaded``: host memory, not in the peak."""
    return {**breakdown, "host_offloaded": monitor.host_offloaded_bytes}


def _peaks(monitor: MemoryMonitor) -> dict[str, Any]:
    """Construction and training peaks apart, and construction's breakdown."""
    return {
        "construction_peak_bytes": monitor.construction_peak_bytes,
        "training_peak_bytes": monitor.training_peak_bytes,
        "construction_breakdown": monitor.breakdown(construction=True),
    }


def run_trial(spec: TrialSpec) -> TrialResult:
    """One rank's trial. ``global_batch_size`` is per rank (the batch each rank trains on), so
    tokens/s here is this rank's; the runner sums the ranks."""
    rank, n_ranks = world()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if spec.backend == "cuda" else torch.device("cpu")
    budget = spec.budget_for_rank(rank)
    monitor: MemoryMonitor = make_monitor(spec.backend, budget, local)
    cfg = spec.config
    losses: list[float] = []
    start = time.perf_counter()
    alloc_conf = os.environ.get(ALLOC_CONF_ENV, "")
    try:
        with monitor:
            # construction: build, techniques (each registered one's ``apply``), engine; its
            # peak is recorded apart
            model = build(spec, device, monitor)
            model.train()
            model = TECHNIQUES.apply(model, cfg, device)
            engine = ENGINES[engine_for(cfg)](model, spec, device, monitor)
            monitor.end_construction()  # construction's peak is kept apart from training's
            # compiled: the first steps compile (their time beyond a measured step's is the
            # compilation), and only the allocator sees what inductor's kernels hold
            compiled = compiles(cfg)
            counted = monitor.allocator_counted if compiled else nullcontext
            warm = []
            for step in range(spec.warmup_steps):
                batches = _on(rank_batches(spec, step, rank, n_ranks), device)
                _sync(device)
                t0 = time.perf_counter()
                with counted():
                    losses.append(engine.step(batches))
                _sync(device)
                warm.append(time.perf_counter() - t0)
                monitor.sample()
            with monitor.pause():
                measured = range(spec.warmup_steps, spec.warmup_steps + spec.measured_steps)
                steps = [_on(rank_batches(spec, s, rank, n_ranks), device) for s in measured]
                times = []
                skipped_before = engine.skipped
                for batches in steps:  # end to end: all micro-batches and the optimizer step
                    _sync(device)
                    t0 = time.perf_counter()
                    losses.append(engine.step(batches))
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                skipped = engine.skipped - skipped_before
            monitor.sample()
        load = os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else 0.0
        step_time, spread = step_statistics(times)
        compile_s = max(0.0, sum(warm) - len(warm) * step_time) if compiled else 0.0
        # fp16 steps the loss scaler skipped took their time but trained no tokens; padding
        # is not a token (a measured step's real tokens, on average)
        real = sum(b.shape.tokens for batches in steps for b in batches)
        tokens_done = measured_tokens(round(real / max(1, len(steps))), len(times), skipped)
        peak = monitor.peak_bytes
        host = host_peak_bytes()
        if spec.host_budget_bytes is not None and host > spec.host_budget_bytes:
            return TrialResult(
                status="oom",
                peak_bytes=peak,
                host_peak_bytes=host,
                error=f"host memory {host} B is over the host budget {spec.host_budget_bytes} B",
                wall_s=time.perf_counter() - start,
                memory_breakdown=_with_host(monitor.breakdown(), monitor),
                **_peaks(monitor),
                oom_rank=rank,
                alloc_conf=alloc_conf,
                device_memory=monitor.extra(),
            )
        return TrialResult(
            status="ok",
            host_peak_bytes=host,
            peak_bytes=peak,
            tokens_per_s=tokens_done / (step_time * len(times)) if step_time else 0.0,
            step_time_s=step_time,
            step_spread=spread,
            compile_s=compile_s,
            load_per_core=load,
            losses=losses,
            wall_s=time.perf_counter() - start,
            memory_breakdown=_with_host(monitor.breakdown() or engine.breakdown(peak), monitor),
            **_peaks(monitor),
            skipped_steps=skipped,
            alloc_conf=alloc_conf,
            device_memory=monitor.extra(),
        )
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        return TrialResult(
            status="oom",
            peak_bytes=max(monitor.peak_bytes, budget or 0),
            losses=losses,
            error=str(exc).splitlines()[0][:500] if str(exc) else "out of memory",
            wall_s=time.perf_counter() - start,
            # what filled the memory when it ran out
            memory_breakdown=_with_host(monitor.breakdown(), monitor),
            **_peaks(monitor),
            oom_rank=rank,
            capped=capped(budget, "oom", spec.backend),
            host_peak_bytes=host_peak_bytes(),
            alloc_conf=alloc_conf,
            device_memory=monitor.extra(),
        )


def host_peak_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m trials.job SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec_path, result_path = Path(args[0]), Path(args[1])
    start_lifeline()
    for lock in clear_stale_locks():  # else DeepSpeed's op loading waits on it forever
        print(f"autotune: removed the stale extension build lock {lock}", file=sys.stderr)
    try:
        spec = TrialSpec.load(spec_path)
        result = run_trial(spec)
    except Exception as exc:  # a trial's failure is data for the study, not a crash of the job
        traceback.print_exc()
        result = TrialResult(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
    rank, n_ranks = world()
    try:
        rank_result_path(result_path, rank, n_ranks).write_text(result.to_json())
    except OSError as exc:  # e.g. a full disk: one line, and the runner reports the trial failed
        print(f"error: could not write the trial result: {exc}", file=sys.stderr, flush=True)
        return 1
    if n_ranks > 1 and result.status != "ok":
        # The other ranks are waiting for this one in a collective: leave now, without the
        # process group's teardown (it would wait for them): a failing exit makes torchrun stop
        # this node's ranks, and the launcher (or srun --kill-on-bad-exit) every other node's.
        sys.stderr.flush()
        os._exit(RANK_FAILED_EXIT)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
