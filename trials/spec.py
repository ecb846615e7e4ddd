"""The contract between the controller and a trial job: a JSON spec in, a JSON result out.

Both sides import these dataclasses; nothing else crosses the process boundary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from trials.data import Documents

Status = Literal["ok", "oom", "failed"]


@dataclass
class TrialSpec:
    """Everything a trial job needs to run one short training job.

    ``config`` holds the technique choices (see ``trials.techniques``); ``model_config``
    is a transformers config as a plain dict, so the job never reaches a model hub.
    """

    model_config: dict[str, Any]
    config: dict[str, Any]
    seq_len: int
    global_batch_size: int
    budget_bytes: int | None = None
    backend: Literal["cpu", "cuda"] = "cpu"
    warmup_steps: int = 2
    measured_steps: int = 2
    seed: int = 0
    lr: float = 1e-3
    nproc: int = 1  # ranks in all (the world size)
    nodes: int = 1  # nodes they span (``nproc / nodes`` per node)
    #: per-rank budget overrides, {"rank": bytes} (tests: one rank of several runs out)
    rank_budget_bytes: dict[str, int] = field(default_factory=dict)
    host_budget_bytes: int | None = None  # host RAM this trial may use (all its ranks)
    #: the data: [MIN, MAX] tokens per document (``trials.data.Documents``); None: every
    #: sequence is ``seq_len`` tokens
    documents: list[int] | None = None
    #: a user's dataset (``trials.user_data``): {"file": its documents file, "sha256": the
    #: file's, "order": each document's token length, in the trial's order}; ``documents``
    #: then holds their [shortest, longest]
    data: dict[str, Any] | None = None
    #: a model folder whose safetensors weights the model starts from (None: random init)
    weights: str | None = None
    #: seconds the controller lets this job run before it is killed (None: the runner's own
    #: limit); derived from the predicted step time (``autotune.trial_cost``)
    timeout_s: float | None = None

    def budget_for_rank(self, rank: int) -> int | None:
        return self.rank_budget_bytes.get(str(rank), self.budget_bytes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> TrialSpec:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass
class TrialResult:
    """What one trial measured. ``peak_bytes`` is the worst rank's peak; ``tokens_per_s``
    counts every rank's tokens of one step over the median measured step time (optimizer step
    included), so one slow step (a page fault, a neighbour's burst) does not move it."""

    status: Status
    peak_bytes: int = 0
    tokens_per_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    error: str = ""
    wall_s: float = 0.0
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    stderr_tail: str = ""
    rank_peaks: list[int] = field(default_factory=list)
    #: a failure of the machine or the scheduler, not of the configuration (a time limit, a
    #: cancelled, pre-empted or vanished Slurm job, sbatch refusing): the same config may run
    #: another time, so the sampler is not told it always fails
    transient: bool = False  # per rank, in a multi-process trial
    #: the peak while the model is built and wrapped (before the first step), and during the
    #: steps; ``peak_bytes`` is the larger, and the budget applies to both
    construction_peak_bytes: int = 0
    training_peak_bytes: int = 0
    oom_rank: int | None = None  # the rank that ran out of memory first (multi-process trials)
    #: run without a budget and out of memory: it hit the physical card (peak = the card)
    capped: bool = False
    skipped_steps: int = 0  # measured fp16 steps the loss scaler skipped (not in tokens/s)
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF the job ran with
    device_memory: dict[str, Any] = field(default_factory=dict)  # CUDA: reserved and card peaks
    #: ``memory_breakdown`` is by role (``trials.roles.ROLES``) at the peak, with the bytes
    #: offloaded to host memory at most beside it (``host_offloaded``); this one is by role at
    #: the construction peak
    construction_breakdown: dict[str, int] = field(default_factory=dict)
    #: host memory: the job's peak resident set (ru_maxrss; all ranks of a host summed), or the
    #: estimator's prediction on the estimate backend
    host_peak_bytes: int = 0
    step_time_s: float = 0.0  # median time of one measured optimizer step (all micro-batches)
    step_spread: float = 0.0  # interquartile range of the measured step times / their median
    load_per_core: float = 0.0  # the machine's 1-minute load average / CPU count, while measuring
    #: a compiled trial's warm-up time beyond as many measured steps: its compilation, kept
    #: apart from the step time (``trials.techniques.compile``)
    compile_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> TrialResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def tracked_steps(backend: str, warmup_steps: int, measured_steps: int) -> int:
    """The steps whose memory a trial measures: on the CPU backend the warm-up steps (the
    tracker is paused while the measured steps are timed); on CUDA the allocator sees all."""
    return warmup_steps if backend == "cpu" else warmup_steps + measured_steps


def trial_documents(spec: TrialSpec, backend: str | None = None) -> Documents | None:
    """The documents of the steps this trial measures the memory of (None: fixed-length
    data): the estimator lays out the same micro-batches. ``backend``: where the prediction is
    for, when not the spec's (a GPU's allocator sees every step)."""
    steps = tracked_steps(backend or spec.backend, spec.warmup_steps, spec.measured_steps)
    if spec.data:
        from trials.user_data import dataset_documents

        timed = (spec.warmup_steps, spec.measured_steps)
        return dataset_documents(spec.data, spec.seed, steps, timed, with_tokens=False)
    return Documents.of(spec.documents, spec.seed, steps)


def rank_result_path(result_path: Path, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` writes its result: the path itself alone, ``NAME.rankR.json`` in a
    multi-process trial (the runner merges them)."""
    if world_size <= 1:
        return result_path
    return result_path.with_name(f"{result_path.stem}.rank{rank}{result_path.suffix}")
