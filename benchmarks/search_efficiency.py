"""Trials-to-optimum of search strategies against an oracle (a benchmark, not a test).

    python benchmarks/search_efficiency.py [--seeds 10] [--cap 400]

For each scenario the whole search space is enumerated on the estimate backend, so the true
optimum is known. Each strategy then searches it, one "trial" at a time, and we count the trials
until it first proposes the optimum or a configuration within 2% of its speed that fits.

The honest part: autotune's strategy orders its candidates with the analytical estimator, so if
the oracle *were* that estimator it would find the optimum at once. Reality differs from any
estimator, so every seed draws a different "reality": the estimator's peak and speed multiplied
by a random factor per technique choice (log-normal, sigma 0.10 on memory and 0.25 on speed for
the main techniques — e.g. one GPU's attention kernel is slower than its roofline, an optimizer
needs more memory than its formula — and 0.02 / 0.05 for tuning knobs such as bucket sizes) and
a per-configuration noise (sigma 0.03 / 0.05). All strategies search the
same realities; only autotune's sees the (wrong) estimator.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GpuSpec, gpu_spec
from autotune.hardware import Hardware
from autotune.models import REGISTRY
from autotune.space import SearchSpace
from autotune.strategy import AutotuneSampler, Observation, config_key
from autotune.units import parse_size

Config = dict[str, Any]
WITHIN = 0.02
#: tuning knobs whose real effect is a few percent (the main techniques get the full sigma)
MINOR = {
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "checkpoint_every",
}


@dataclass
class Scenario:
    name: str
    model: str
    budget: str
    gpu: str
    nproc: int

    def setup(self) -> tuple[list[Config], Callable[[Config], tuple[float, float]], float]:
        entry = REGISTRY[self.model]
        gpu: GpuSpec = gpu_spec(self.gpu)
        grid = self.space().grid()
        est = AnalyticalEstimator()

        def predict(c: Config) -> tuple[float, float]:
            e = est.estimate(
                entry.config,
                c,
                seq_len=entry.seq_len,
                global_batch_size=entry.global_batch_size,
                nproc=self.nproc,
                gpu=gpu,
            )
            return float(e.peak_bytes), float(e.tokens_per_s)

        return grid, predict, float(parse_size(self.budget))

    def space(self) -> SearchSpace:
        """The default space, resolved for the target GPU (every CUDA technique available)."""
        hw = Hardware(
            backend="cuda",
            cuda_capability=gpu_spec(self.gpu).sm,
            gpu_count=self.nproc,
            has_flash_attn=True,
            has_bitsandbytes=True,
            has_peft=True,
            has_deepspeed=True,
        )
        space = SearchSpace.load().resolve(REGISTRY[self.model].global_batch_size, hw)
        # the allocator setting is a real choice on a GPU, but neither the estimator nor the
        # simulated reality models it: left out, the grid is the one the README counts
        dims = [d for d in space.dimensions if d.name != "expandable_segments"]
        return SearchSpace(dims, space.rules, dict(space.reference), space.source, space.dropped)


SCENARIOS = [
    Scenario("llama-7b, 1x RTX 4090 (24GB)", "llama-7b", "24GB", "rtx4090", 1),
    Scenario("llama-70b, 8x H100 80GB", "llama-70b", "80GB", "h100", 8),
]


def make_reality(
    grid: list[Config], prior: dict[Any, tuple[float, float]], seed: int
) -> dict[Any, tuple[float, float]]:
    rng = random.Random(seed)
    factors: dict[tuple[str, str, str], float] = {}

    def factor(kind: str, k: str, v: Any, sigma: float) -> float:
        key = (kind, k, repr(v))
        if key not in factors:
            factors[key] = math.exp(rng.gauss(0.0, sigma))
        return factors[key]

    truth = {}
    for c in grid:
        peak, speed = prior[config_key(c)]
        for k, v in sorted(c.items()):
            minor = k in MINOR
            peak *= factor("peak", k, v, 0.02 if minor else 0.10)
            speed *= factor("speed", k, v, 0.05 if minor else 0.25)
        peak *= math.exp(rng.gauss(0.0, 0.03))
        speed *= math.exp(rng.gauss(0.0, 0.05))
        truth[config_key(c)] = (peak, speed)
    return truth


def optimum(truth: dict[Any, tuple[float, float]], budget: float) -> float:
    return max(s for p, s in truth.values() if p <= budget)


def hit(c: Config, truth: dict[Any, tuple[float, float]], budget: float, best: float) -> bool:
    peak, speed = truth[config_key(c)]
    return peak <= budget and speed >= (1 - WITHIN) * best


def run_order(order: list[Config], truth: dict[Any, Any], budget: float, best: float) -> int | None:
    for i, c in enumerate(order, 1):
        if hit(c, truth, budget, best):
            return i
    return None


def run_optuna(
    sampler: optuna.samplers.BaseSampler,
    space: SearchSpace,
    truth: dict[Any, Any],
    budget: float,
    best: float,
    cap: int,
    multi: bool,
) -> int | None:
    study = optuna.create_study(
        directions=["maximize", "minimize"] if multi else ["maximize"], sampler=sampler
    )
    for i in range(1, cap + 1):
        trial = study.ask()
        c = space.sample(trial.suggest_categorical)  # type: ignore[arg-type]
        peak, speed = truth[config_key(c)]
        fits = peak <= budget
        trial.set_constraint("memory", (peak - budget) / budget)
        trial.set_user_attr("config", c)
        # an OOM measures no speed
        study.tell(trial, (speed if fits else 0.0, peak) if multi else speed if fits else 0.0)
        if hit(c, truth, budget, best):
            return i
    return None


def run_autotune(
    sampler: AutotuneSampler, truth: dict[Any, Any], budget: float, best: float, cap: int
) -> int | None:
    """The planner is stateless between runs: its only input is the history it is given."""
    history: list[Observation] = []
    for i in range(1, cap + 1):
        c = sampler.plan(history)
        if c is None:
            return None
        peak, speed = truth[config_key(c)]
        fits = peak <= budget
        history.append(
            Observation(
                c, "ok" if fits else "oom", peak if fits else budget, speed if fits else 0.0
            )
        )
        if hit(c, truth, budget, best):
            return i
    return None


@dataclass
class Run:
    seed: int
    grid: list[Config]
    space: SearchSpace
    autotune: AutotuneSampler
    truth: dict[Any, tuple[float, float]]
    budget: float
    best: float
    cap: int


def _shuffled(run: Run) -> list[Config]:
    order = run.grid[:]
    random.Random(1000 + run.seed).shuffle(order)
    return order


#: strategy -> trials until the optimum (None: not within the cap); grid and random walk the
#: whole grid without repeats, the Optuna samplers and autotune stop at the cap
STRATEGIES: dict[str, Callable[[Run], int | None]] = {
    "grid order": lambda r: run_order(r.grid, r.truth, r.budget, r.best),
    "random": lambda r: run_order(_shuffled(r), r.truth, r.budget, r.best),
    "TPE (constraints)": lambda r: run_optuna(
        optuna.samplers.TPESampler(seed=r.seed, multivariate=True, group=True),
        r.space,
        r.truth,
        r.budget,
        r.best,
        r.cap,
        multi=False,
    ),
    "NSGA-II": lambda r: run_optuna(
        optuna.samplers.NSGAIISampler(seed=r.seed),
        r.space,
        r.truth,
        r.budget,
        r.best,
        r.cap,
        multi=True,
    ),
    "autotune": lambda r: run_autotune(r.autotune, r.truth, r.budget, r.best, r.cap),
}


def summarise(counts: list[int | None], cap: int) -> tuple[str, str, float]:
    found = [c if c is not None else cap + 1 for c in counts]
    med = statistics.median(found)
    worst = max(found)

    def fmt(n: float) -> str:
        return f">{cap}" if n > cap else f"{n:g}"

    return fmt(med), fmt(worst), med


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--cap", type=int, default=400, help="most trials per strategy run")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--scenarios", default="all", help="indices, e.g. 0 or 0,1")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")
    names = args.strategies.split(",")
    picked = (
        SCENARIOS
        if args.scenarios == "all"
        else [SCENARIOS[int(i)] for i in args.scenarios.split(",")]
    )
    for sc in picked:
        t0 = time.perf_counter()
        grid, predict, budget = sc.setup()
        space = sc.space()
        prior = {config_key(c): predict(c) for c in grid}
        autotune = AutotuneSampler(grid, lambda c, p=prior: p[config_key(c)], budget)
        cap = min(args.cap, len(grid))
        results: dict[str, list[int | None]] = {k: [] for k in names}
        for seed in range(args.seeds):
            truth = make_reality(grid, prior, seed)
            run = Run(seed, grid, space, autotune, truth, budget, optimum(truth, budget), cap)
            for name in names:
                results[name].append(STRATEGIES[name](run))
        print(
            f"\n## {sc.name}: grid of {len(grid)} configurations, budget {sc.budget}, "
            f"{args.seeds} seeds, cap {cap} trials ({time.perf_counter() - t0:.0f}s)\n"
        )
        print("| strategy | median trials | worst | median % of grid |")
        print("|---|---|---|---|")
        medians = {}
        for name, counts in results.items():
            limit = len(grid) if name in ("grid order", "random") else cap
            med, worst, m = summarise(counts, limit)
            medians[name] = m
            print(f"| {name} | {med} | {worst} | {100 * m / len(grid):.2f}% |")
        if "random" in medians and "autotune" in medians:
            print(
                f"\nrandom / autotune median ratio: {medians['random'] / medians['autotune']:.0f}x"
            )


if __name__ == "__main__":
    main()
