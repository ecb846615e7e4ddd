"""The job one trial runs: ``python -m trials.job SPEC.json RESULT.json``.

It builds the model from its config (random init, fixed seed), applies each technique of the
trial config for real, runs warm-up steps (memory tracked, budget enforced) and measured steps
(timed end to end, optimizer step included), and writes a ``TrialResult``. An out-of-memory error
is a result (``oom``), not a crash; any other exception is ``failed`` with its text.
"""

from __future__ import annotations

import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trials.data import batch_for_step
from trials.lifeline import start_lifeline
from trials.memory import MemoryMonitor, make_monitor
from trials.spec import TrialResult, TrialSpec
from trials.techniques import ATTENTION, CHECKPOINTING, OPTIMIZERS, PRECISIONS


def build_model(model_config: dict[str, Any], attention: str, seed: int) -> nn.Module:
    """A transformers causal LM from a config dict, randomly initialised with ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model_config)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION[attention])


@dataclass
class Trainer:
    """One optimizer step = ``global_batch / micro_batch`` micro-batches, losses averaged."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    spec: TrialSpec
    device: torch.device

    def __post_init__(self) -> None:
        cfg = self.spec.config
        self.micro_batch = int(cfg.get("micro_batch_size", self.spec.global_batch_size))
        if self.spec.global_batch_size % self.micro_batch:
            raise ValueError(
                f"micro_batch_size {self.micro_batch} does not divide "
                f"global_batch_size {self.spec.global_batch_size}"
            )
        self.accum = self.spec.global_batch_size // self.micro_batch
        precision = PRECISIONS[cfg.get("precision", "fp32")]
        self.autocast_dtype = precision.autocast_dtype
        self.scaler = torch.amp.GradScaler(self.device.type) if precision.loss_scaling else None
        self.vocab = int(self.spec.model_config["vocab_size"])

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, step: int) -> float:
        spec = self.spec
        tokens = batch_for_step(step, spec.global_batch_size, spec.seq_len, self.vocab, spec.seed)
        tokens = tokens.to(self.device)
        total = 0.0
        for i in range(self.accum):
            ids = tokens[i * self.micro_batch : (i + 1) * self.micro_batch]
            with self._autocast():
                loss = self.model(input_ids=ids, labels=ids).loss / self.accum
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            total += float(loss.detach())
            del loss
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, peak: int) -> dict[str, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    grads = params  # gradients are freed by zero_grad; at the peak they exist in full precision
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_states": states,
        "activations_and_other": max(0, peak - params - grads - states),
    }


def run_trial(spec: TrialSpec, rank: int = 0) -> TrialResult:
    device = torch.device("cuda", rank) if spec.backend == "cuda" else torch.device("cpu")
    monitor: MemoryMonitor = make_monitor(spec.backend, spec.budget_bytes, rank)
    cfg = spec.config
    losses: list[float] = []
    start = time.perf_counter()
    try:
        with monitor:
            with device:
                model = build_model(spec.model_config, cfg.get("attention", "sdpa"), spec.seed)
            model.train()
            CHECKPOINTING[cfg.get("gradient_checkpointing", "off")](model, cfg)
            optimizer = OPTIMIZERS[cfg.get("optimizer", "adamw")].factory(
                model.parameters(), spec.lr
            )
            trainer = Trainer(model, optimizer, spec, device)
            for step in range(spec.warmup_steps):
                losses.append(trainer.step(step))
            with monitor.pause():
                _sync(device)
                t0 = time.perf_counter()
                for step in range(spec.warmup_steps, spec.warmup_steps + spec.measured_steps):
                    losses.append(trainer.step(step))
                _sync(device)
                elapsed = time.perf_counter() - t0
        tokens = spec.global_batch_size * spec.seq_len * spec.measured_steps * spec.nproc
        peak = monitor.peak_bytes
        return TrialResult(
            status="ok",
            peak_bytes=peak,
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
            losses=losses,
            wall_s=time.perf_counter() - start,
            memory_breakdown=_breakdown(model, optimizer, peak),
        )
    except torch.OutOfMemoryError as exc:
        return TrialResult(
            status="oom",
            peak_bytes=max(monitor.peak_bytes, spec.budget_bytes or 0),
            losses=losses,
            error=str(exc).splitlines()[0][:500] if str(exc) else "out of memory",
            wall_s=time.perf_counter() - start,
        )


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
    result_path.write_text(result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
