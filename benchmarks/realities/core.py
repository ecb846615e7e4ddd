"""Realities for the search benchmark: every configuration's true outcome, and the optimum.

A reality answers "what would this trial measure" for every configuration of a finite space:
its status (``ok``, ``oom`` over the budget, ``failed``: a crash), its peak memory and tokens/s,
its loss curve, and what the trial costs in wall-clock. None is the analytical estimator the
strategy orders its candidates with:

* measured: a table of real CPU trials (``measure.py``), replayed by ``table_reality``;
* traced: the traced estimator (a fake-tensor run of the trial's own step) plus the
  construction peak of the device model, as a table (``trace.py``), replayed;
* ``interaction_reality``: the analytical model times main effects, *pairwise* interaction terms
  (checkpointing x micro-batch, offload x ZeRO stage, precision x attention, ...) and crashes of
  some combinations, a new draw per seed.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.availability import Hardware
from autotune.space import SearchSpace
from autotune.strategy import config_key
from trials.techniques import is_exact

Config = dict[str, Any]
Key = tuple[tuple[str, str], ...]
HERE = Path(__file__).resolve().parent
#: a configuration within this fraction of the optimum's tokens/s counts as reaching it
WITHIN = 0.02
#: the study's loss guard (autotune.study.EXACT_RTOL, --loss-tolerance default), restated
EXACT_RTOL = 1e-3
LOSS_TOLERANCE = 0.02


@dataclass(frozen=True)
class Outcome:
    """What a trial of one configuration measures (peak: the true one, even over budget)."""

    status: str  # ok | failed (over the budget is decided by the reality's budget)
    peak_bytes: float
    tokens_per_s: float
    #: seconds the trial takes when it runs to the end, and when it stops at an OOM
    wall_s: float
    oom_wall_s: float
    losses: tuple[float, ...] = ()
    error: str = ""


@dataclass
class Reality:
    name: str
    space: SearchSpace
    budget_bytes: float
    outcomes: dict[Key, Outcome]
    #: what the study settings need: model, shape, ranks
    model: str
    model_config: dict[str, Any]
    seq_len: int
    global_batch_size: int
    nproc: int = 1
    backend: str = "cpu"
    #: the GPU a study on this reality runs on ("" for the CPU)
    gpu: str = ""
    #: steps whose mean loss the guard compares for lossy configurations
    measured_steps: int = 2
    limits: str = ""
    grid: list[Config] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.grid:
            self.grid = self.space.grid()
        missing = [c for c in self.grid if config_key(c) not in self.outcomes]
        if missing:
            raise ValueError(
                f"{self.name}: no outcome for {len(missing)} configs, e.g. {missing[0]}"
            )

    def outcome(self, config: Config) -> Outcome:
        return self.outcomes[config_key(config)]

    @property
    def reference_losses(self) -> tuple[float, ...]:
        return self.outcome(self.space.reference_config()).losses

    def status(self, config: Config, budget: float | None = None) -> str:
        """ok / oom / failed for a trial run with ``budget`` (None: unbounded)."""
        o = self.outcome(config)
        if o.status != "ok":
            return o.status
        limit = self.budget_bytes if budget is None else budget
        return "oom" if o.peak_bytes > limit else "ok"

    def loss_ok(self, config: Config) -> bool:
        """The study's loss guard: exact techniques match the reference per step within 1e-3,
        lossy ones may regress the mean of the measured steps by 2%."""
        losses, ref = self.outcome(config).losses, self.reference_losses
        n = min(len(losses), len(ref))
        if n == 0:
            return True
        if is_exact(config):
            return all(abs(a - b) <= EXACT_RTOL * abs(b) for a, b in zip(losses, ref, strict=False))
        k = max(1, min(self.measured_steps, n))
        mean, base = sum(losses[n - k : n]) / k, sum(ref[n - k : n]) / k
        return (mean - base) / abs(base) <= LOSS_TOLERANCE

    def feasible(self, config: Config) -> bool:
        return self.status(config) == "ok" and self.loss_ok(config)

    def optimum(self) -> tuple[Config, float]:
        best = max(
            (c for c in self.grid if self.feasible(c)),
            key=lambda c: self.outcome(c).tokens_per_s,
        )
        return best, self.outcome(best).tokens_per_s

    def hit(self, config: Config) -> bool:
        """Feasible and within 2% of the optimum's speed."""
        return (
            self.feasible(config)
            and self.outcome(config).tokens_per_s >= (1 - WITHIN) * self.optimum_speed
        )

    @property
    def optimum_speed(self) -> float:
        if not hasattr(self, "_best"):
            self._best = self.optimum()[1]
        return self._best

    def cost_s(self, config: Config) -> float:
        """Wall-clock the trial costs: to the end, or to the OOM."""
        o = self.outcome(config)
        return o.oom_wall_s if self.status(config) == "oom" else o.wall_s


# --- replayed tables (measured, traced) -----------------------------------------------------------


def load_table(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def table_reality(
    name: str,
    path: Path,
    space_path: Path,
    budget_bytes: float,
    limits: str,
    *,
    nproc: int = 1,
    backend: str = "cpu",
    gpu: str = "",
    hardware: Hardware | None = None,
) -> Reality:
    """A reality replayed from a table of rows (measured or traced, unbounded peaks)."""
    table = load_table(path)
    space = SearchSpace.load(space_path).resolve(
        int(table["global_batch_size"]), hardware or Hardware.detect("cpu")
    )
    outcomes: dict[Key, Outcome] = {}
    for row in table["rows"]:
        wall = float(row["wall_s"])
        outcomes[config_key(row["config"])] = Outcome(
            status="failed" if row["status"] == "failed" else "ok",
            peak_bytes=float(row["peak_bytes"]),
            tokens_per_s=float(row["tokens_per_s"]),
            wall_s=wall,
            # the table ran unbounded; an OOM stops the trial in its warm-up, so it is charged
            # the setup and warm-up share of the run: the run less its timed steps
            oom_wall_s=float(row.get("oom_wall_s", wall)),
            losses=tuple(row.get("losses") or ()),
            error=row.get("error", ""),
        )
    return Reality(
        name=name,
        space=space,
        budget_bytes=budget_bytes,
        outcomes=outcomes,
        model=str(table["model"]),
        model_config=table["model_config"],
        seq_len=int(table["seq_len"]),
        global_batch_size=int(table["global_batch_size"]),
        nproc=nproc,
        backend=backend,
        gpu=gpu,
        measured_steps=int(table.get("measured_steps", 2)),
        limits=limits,
    )


# --- the analytical model with pairwise interactions and crashes ---

#: pairs of dimensions whose joint effect is not the product of their own (log sigma: memory,
#: speed): recomputation costs more at a big micro-batch, offload's copies depend on what ZeRO
#: shards, attention kernels differ by precision, buckets matter by stage
INTERACTIONS: dict[tuple[str, str], tuple[float, float]] = {
    ("gradient_checkpointing", "micro_batch_size"): (0.15, 0.20),
    ("offload_optimizer", "zero_stage"): (0.15, 0.30),
    ("offload_param", "micro_batch_size"): (0.10, 0.25),
    ("precision", "attention"): (0.10, 0.25),
    ("zero_stage", "micro_batch_size"): (0.10, 0.15),
    ("reduce_bucket_size", "zero_stage"): (0.10, 0.10),
}
MAIN_SIGMA = (0.10, 0.25)
NOISE_SIGMA = (0.03, 0.05)
#: crashing pairs of choices drawn per seed (plus the one every seed has)
RANDOM_CRASHES = 3
#: flash-attention has no fp32 kernel: a real crash, in every seed
ALWAYS_CRASH = ({"attention": "flash_attention_2", "precision": "fp32"},)
#: seconds a trial spends before its first step (process, model build, engine), per reality
SETUP_S = 90.0
STEPS = 4  # warm-up + measured


def interaction_reality(
    name: str,
    space: SearchSpace,
    predict: Callable[[Config], tuple[float, float]],
    budget_bytes: float,
    seed: int,
    settings: dict[str, Any],
    limits: str,
) -> Reality:
    """``predict``'s (peak, tokens/s) times random main effects, pairwise interaction terms
    and per-configuration noise, with crashing combinations; one draw per ``seed``."""
    rng = random.Random(seed)
    grid = space.grid()
    factors: dict[tuple[Any, ...], float] = {}

    def factor(*key: Any, sigma: float) -> float:
        if key not in factors:
            factors[key] = math.exp(rng.gauss(0.0, sigma))
        return factors[key]

    values: dict[str, set[str]] = {}
    for c in grid:
        for k, v in c.items():
            values.setdefault(k, set()).add(repr(v))
    choices = sorted((k, v) for k, vs in values.items() if len(vs) > 1 for v in vs)
    # a crash is a set of (dimension, repr of value) that fails together, whatever else is chosen
    crashes = [{k: repr(v) for k, v in c.items()} for c in ALWAYS_CRASH]
    pairs = [(a, b) for a, b in itertools.combinations(choices, 2) if a[0] != b[0]]
    for a, b in rng.sample(pairs, RANDOM_CRASHES):
        crashes.append({a[0]: a[1], b[0]: b[1]})
    gbs, seq = int(settings["global_batch_size"]), int(settings["seq_len"])
    outcomes: dict[Key, Outcome] = {}
    for c in grid:
        peak, speed = predict(c)
        for k, v in sorted(c.items()):
            peak *= factor("peak", k, repr(v), sigma=MAIN_SIGMA[0])
            speed *= factor("speed", k, repr(v), sigma=MAIN_SIGMA[1])
        for (a, b), (s_peak, s_speed) in INTERACTIONS.items():
            if a in c and b in c:
                pair = (a, repr(c[a]), b, repr(c[b]))
                peak *= factor("peak", *pair, sigma=s_peak)
                speed *= factor("speed", *pair, sigma=s_speed)
        peak *= math.exp(rng.gauss(0.0, NOISE_SIGMA[0]))
        speed *= math.exp(rng.gauss(0.0, NOISE_SIGMA[1]))
        reprs = {k: repr(v) for k, v in c.items()}
        crashed = any(all(reprs.get(k) == v for k, v in crash.items()) for crash in crashes)
        step_s = gbs * seq * int(settings.get("nproc", 1)) / speed
        outcomes[config_key(c)] = Outcome(
            status="failed" if crashed else "ok",
            peak_bytes=peak,
            tokens_per_s=speed,
            wall_s=SETUP_S / 3 if crashed else SETUP_S + STEPS * step_s,
            oom_wall_s=SETUP_S + step_s,
            losses=(),
        )
    return Reality(
        name=name,
        space=space,
        budget_bytes=budget_bytes,
        outcomes=outcomes,
        model=str(settings["model"]),
        model_config=settings["model_config"],
        seq_len=seq,
        global_batch_size=gbs,
        nproc=int(settings.get("nproc", 1)),
        backend="cuda",
        gpu=str(settings.get("gpu", "")),
        limits=limits,
        grid=grid,
    )


# --- where the estimator's prior is wrong ---------------------------------------------------------

#: how much faster the rewarded choice runs than the estimator believes: enough that the
#: optimum takes it although the prior ranks it last in its dimension
MISLED_REWARD = 2.5
#: dimensions whose worst-ranked choice a seed may reward (each is a real case of an estimator
#: off by a factor: an eager kernel a compiler fuses, a CPU offload overlapped with compute, a
#: recomputation hidden under communication, ZeRO-0's all-reduce on a fast fabric)
MISLED_DIMENSIONS = ("attention", "offload_optimizer", "gradient_checkpointing", "zero_stage")


def lowest_ranked_choice(
    grid: list[Config], predict: Callable[[Config], tuple[float, float]], dim: str
) -> Any:
    """The choice of ``dim`` with the lowest mean predicted log tokens/s over the grid."""
    sums: dict[str, list[float]] = {}
    values: dict[str, Any] = {}
    for c in grid:
        if dim in c:
            sums.setdefault(repr(c[dim]), []).append(math.log(predict(c)[1]))
            values[repr(c[dim])] = c[dim]
    worst = min(sums, key=lambda v: sum(sums[v]) / len(sums[v]))
    return values[worst]


def misled_reality(
    name: str,
    space: SearchSpace,
    predict: Callable[[Config], tuple[float, float]],
    budget_bytes: float,
    seed: int,
    settings: dict[str, Any],
    limits: str,
) -> Reality:
    """``interaction_reality``, plus: the choice the estimator ranks lowest in one dimension
    (drawn per seed from ``MISLED_DIMENSIONS``) runs ``MISLED_REWARD`` times faster than
    the rest of the draw says, so the optimum sits where the prior does not look."""
    base = interaction_reality(name, space, predict, budget_bytes, seed, settings, limits)
    rng = random.Random(f"misled-{seed}")
    dims = [d for d in MISLED_DIMENSIONS if any(d in c for c in base.grid)]
    dim = rng.choice(dims)
    value = lowest_ranked_choice(base.grid, predict, dim)
    gbs, seq = base.global_batch_size, base.seq_len
    for c in base.grid:
        if c.get(dim) != value:
            continue
        key = config_key(c)
        o = base.outcomes[key]
        if o.status != "ok":
            continue
        speed = o.tokens_per_s * MISLED_REWARD
        step_s = gbs * seq * base.nproc / speed
        base.outcomes[key] = replace(
            o, tokens_per_s=speed, wall_s=SETUP_S + STEPS * step_s, oom_wall_s=SETUP_S + step_s
        )
    base.limits = f"{limits}; rewarded: {dim}={value!r} x{MISLED_REWARD:g}"
    return base
