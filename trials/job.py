"""The job one trial runs: ``python -m trials.job SPEC.json RESULT.json``.

It builds the model from its config (random init, fixed seed), applies each technique of the
trial config for real, runs warm-up steps (memory tracked, budget enforced) and measured steps
(timed end to end, optimizer step included), and writes a ``TrialResult``. An out-of-memory error
is a result (``oom``), not a crash; any other exception is ``failed`` with its text.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trials.data import batch_for_step
from trials.engines import ENGINES, engine_for, world
from trials.lifeline import start_lifeline
from trials.memory import MemoryMonitor, make_monitor
from trials.quantization import QUANTIZATION
from trials.spec import TrialResult, TrialSpec, rank_result_path
from trials.techniques import ATTENTION, CHECKPOINTING


def build_model(model_config: dict[str, Any], attention: str, seed: int) -> nn.Module:
    """A transformers causal LM from a config dict, randomly initialised with ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model_config)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION[attention])


def rank_batch(spec: TrialSpec, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of step ``step``: the same tokens, split across ranks, whatever N."""
    gbs = spec.global_batch_size
    vocab = int(spec.model_config["vocab_size"])
    tokens = batch_for_step(step, gbs * world, spec.seq_len, vocab, spec.seed)
    return tokens[rank * gbs : (rank + 1) * gbs]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _with_host(breakdown: dict[str, int], monitor: MemoryMonitor) -> dict[str, int]:
    """The device's roles, and beside them ``host_offloaded``: host memory, not in the peak."""
    return {**breakdown, "host_offloaded": monitor.host_peak_bytes}


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
    monitor: MemoryMonitor = make_monitor(spec.backend, spec.budget_bytes, local)
    cfg = spec.config
    losses: list[float] = []
    start = time.perf_counter()
    try:
        with monitor:
            with device:
                model = build_model(spec.model_config, cfg.get("attention", "sdpa"), spec.seed)
            model.train()
            CHECKPOINTING[cfg.get("gradient_checkpointing", "off")](model, cfg)
            model = QUANTIZATION[str(cfg.get("quantization", "none"))](model, device)
            engine = ENGINES[engine_for(cfg)](model, spec, device, monitor)
            monitor.end_construction()  # construction's peak is kept apart from training's
            for step in range(spec.warmup_steps):
                losses.append(engine.step(rank_batch(spec, step, rank, n_ranks).to(device)))
            with monitor.pause():
                measured = range(spec.warmup_steps, spec.warmup_steps + spec.measured_steps)
                batches = [rank_batch(spec, s, rank, n_ranks).to(device) for s in measured]
                _sync(device)
                t0 = time.perf_counter()  # end to end: all micro-batches and optimizer steps
                for tokens in batches:
                    losses.append(engine.step(tokens))
                _sync(device)
                elapsed = time.perf_counter() - t0
        tokens_done = spec.global_batch_size * spec.seq_len * spec.measured_steps
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
            )
        return TrialResult(
            status="ok",
            host_peak_bytes=host,
            peak_bytes=peak,
            tokens_per_s=tokens_done / elapsed if elapsed > 0 else 0.0,
            losses=losses,
            wall_s=time.perf_counter() - start,
            memory_breakdown=_with_host(monitor.breakdown() or engine.breakdown(peak), monitor),
            **_peaks(monitor),
        )
    except torch.OutOfMemoryError as exc:
        return TrialResult(
            status="oom",
            peak_bytes=max(monitor.peak_bytes, spec.budget_bytes or 0),
            losses=losses,
            error=str(exc).splitlines()[0][:500] if str(exc) else "out of memory",
            wall_s=time.perf_counter() - start,
            memory_breakdown=_with_host(
                monitor.breakdown(), monitor
            ),  # what filled the memory when it ran out
            **_peaks(monitor),
            host_peak_bytes=host_peak_bytes(),
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
    try:
        result = run_trial(TrialSpec.load(spec_path))
    except Exception as exc:  # a trial's failure is data for the study, not a crash of the job
        traceback.print_exc()
        result = TrialResult(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
    rank, n_ranks = world()
    rank_result_path(result_path, rank, n_ranks).write_text(result.to_json())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
