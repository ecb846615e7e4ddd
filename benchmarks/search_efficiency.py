"""Trials to the optimum of autotune's strategy and its peers, on realities it was not built on.

    python benchmarks/search_efficiency.py [--seeds 20] [--realities measured,traced,interactions]

Each reality (``benchmarks/realities/core.py``) knows every configuration's outcome, so its
optimum (the fastest configuration that fits the budget and passes the loss guard) is known.
Every peer searches it from scratch, one trial at a time, and we count the real trials until the
first one within 2% of the optimum's tokens/s that fits; the trials spent on OOMs and on
crashes; and the wall-clock those trials cost. autotune (``--strategy autotune``), the study's
TPE (``--strategy tpe``) and NSGA-II run as a study does: a real Optuna study with the study's
``Objective``, reference trial, constraints and duplicate reuse, whose runner replays the reality
instead of launching a job (a reused duplicate is no trial). Random search walks the grid in a
random order without repeats, the grid in its declaration order, and the DeepSpeed-style tuner
follows ``deepspeed/autotuning/autotuner.py`` (see ``deepspeed_style``).
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.availability import Hardware
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import gpu_spec
from autotune.estimator.workload import Workload
from autotune.models import MODELS, stats_of
from autotune.runner import TrialRunner
from autotune.space import SearchSpace
from autotune.study import (
    Objective,
    StudySettings,
    TrialCrashed,
    create_or_load,
    ensure_reference,
    make_sampler,
)
from benchmarks.realities.core import (
    HERE,
    Config,
    Reality,
    interaction_reality,
    misled_reality,
    table_reality,
)
from trials.spec import TrialResult, TrialSpec

MIB = 2**20


# --- the record of one search -------------------------------------------------------------------


@dataclass
class Search:
    """The real trials one peer ran, in order, until it reached the optimum or gave up."""

    reality: Reality
    cap: int
    runs: list[tuple[Config, str, float]] = field(default_factory=list)  # config, status, cost
    found_at: int | None = None

    def run(self, config: Config, unbounded: bool = False) -> str:
        """Run one trial (as the reality answers it) and note whether it reached the optimum."""
        r = self.reality
        status = r.status(config, budget=math.inf if unbounded else None)
        cost = r.outcome(config).wall_s if unbounded or status != "oom" else r.cost_s(config)
        # recorded against the budget: an unbounded run over it (the study's reference) ran to
        # the end but did not fit, and counts with the OOMs
        self.runs.append((config, r.status(config), cost))
        if self.found_at is None and r.hit(config):
            self.found_at = len(self.runs)
        return status

    @property
    def done(self) -> bool:
        return self.found_at is not None or len(self.runs) >= self.cap

    def spent(self) -> list[tuple[Config, str, float]]:
        return self.runs[: self.found_at or len(self.runs)]


class ReplayRunner(TrialRunner):
    """A study's runner that answers from the reality instead of launching the job."""

    def __init__(self, search: Search) -> None:
        self.search = search

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        r = self.search.reality
        o = r.outcome(spec.config)
        status = self.search.run(spec.config, unbounded=spec.budget_bytes is None)
        cost = self.search.runs[-1][2]
        if status == "failed":
            return TrialResult("failed", error=o.error or "crashed (replayed)", wall_s=cost)
        if status == "oom":
            budget = float(spec.budget_bytes or r.budget_bytes)
            return TrialResult("oom", peak_bytes=int(budget) + 1, error="replayed OOM", wall_s=cost)
        return TrialResult(
            "ok",
            peak_bytes=int(o.peak_bytes),
            tokens_per_s=o.tokens_per_s,
            losses=list(o.losses),
            wall_s=cost,
        )


# --- the peers ----------------------------------------------------------------------------------

SamplerFactory = Callable[[optuna.Study, SearchSpace, int], optuna.samplers.BaseSampler]


def study_search(reality: Reality, factory: SamplerFactory, seed: int, cap: int) -> Search:
    """The peer as a study runs it (controller.optimize): reference first, the study's objective."""
    search = Search(reality, cap)
    settings = StudySettings(
        model=reality.model,
        model_config=reality.model_config,
        budget_bytes=int(reality.budget_bytes),
        budget_label=f"{reality.budget_bytes / MIB:.0f}MiB",
        backend=reality.backend,
        seq_len=reality.seq_len,
        global_batch_size=reality.global_batch_size,
        space=reality.space.as_dict(),
        seed=seed,
        nproc=reality.nproc,
        # a study on the GPU detects it (hardware.detected_gpu_key) and its prior is priced for
        # it; this machine has none, so the reality's GPU is named
        target_gpu=reality.gpu,
    )
    study = create_or_load(optuna.storages.InMemoryStorage(), "bench", settings)  # type: ignore[arg-type]
    objective = Objective(study, reality.space, ReplayRunner(search))
    ensure_reference(study, reality.space)
    study.sampler = factory(study, reality.space, seed)
    # a sampler that proposes only reused duplicates never ends: bound the study trials too
    for _ in range(20 * cap):
        if search.done:
            break
        study.optimize(objective, n_trials=1, catch=(TrialCrashed,))
    return search


def strategy(name: str) -> SamplerFactory:
    """A ``--strategy`` of the CLI, through the study's own ``make_sampler``."""

    def factory(study: optuna.Study, space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
        return make_sampler(study, seed, space=space, strategy=name)

    return factory


def nsga2(study: optuna.Study, space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed)  # reads Trial.set_constraint's constraints


def order_search(reality: Reality, order: list[Config], cap: int) -> Search:
    search = Search(reality, cap)
    for c in order:
        if search.done:
            break
        search.run(c)
    return search


def random_search(reality: Reality, seed: int, cap: int) -> Search:
    order = reality.grid[:]
    random.Random(seed).shuffle(order)
    return order_search(reality, order, cap)


#: the ZeRO knobs DeepSpeed's autotuner tunes per stage; the rest is the user's own config
ZERO_KNOBS = (
    "offload_optimizer",
    "offload_param",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
)
DS_EARLY_STOPPING = 5  # AUTOTUNING_TUNER_EARLY_STOPPING_DEFAULT
DS_NUM_TRIALS = 50  # AUTOTUNING_TUNER_NUM_TRIALS_DEFAULT


def instantiation_bytes(n_params: int, half: bool, stage: int, gpus: int) -> float:
    """``Autotuner.get_instantiation_memory_required_per_gpu``: Adam's model states per GPU."""
    params = n_params * (2 if half else 4)
    grads = n_params * (2 if half else 4)
    optim = n_params * (16 if half else 8)
    if stage >= 1:
        optim /= gpus
    if stage >= 2:
        grads /= gpus
    if stage >= 3:
        params /= gpus
    return params + grads + optim


def deepspeed_style(reality: Reality, cap: int) -> Search:
    """DeepSpeed's autotuner (``Autotuner.tune``), once per setting of what it does not tune.

    DeepSpeed tunes the ZeRO stage, the micro-batch and the stage's knobs; precision,
    checkpointing and attention are the user's config. So the user's settings are tried one after
    another (in the space's order), and for each: a profile run (stage 3, micro-batch 1) measures
    the activation memory; stages 0-3 whose model states (DeepSpeed's formula, no offload) plus
    that activation fit are tuned in turn: micro-batches ascending up to the calculated maximum
    until one runs out of memory; a stage > 0 that beats neither the previous stage's best
    micro-batch nor its metric ends there, else its knobs (offload, buckets, overlap) are
    grid-searched at the best micro-batch with DeepSpeed's early stopping (5 trials without
    gain, at most 50). DeepSpeed's model-based tuner (XGBoost cost model) is not reproduced: its
    default tuner is this grid search."""
    search = Search(reality, cap)
    grid = reality.grid
    n_params = stats_of(reality.model_config).n_params
    user_dims = [
        d.name
        for d in reality.space.dimensions
        if d.name not in (*ZERO_KNOBS, "zero_stage", "micro_batch_size")
    ]
    settings: list[dict[str, Any]] = []
    for c in grid:
        u = {d: c.get(d) for d in user_dims}
        if u not in settings:
            settings.append(u)

    def matching(**fixed: Any) -> list[Config]:
        return [c for c in grid if all(c.get(k) == v for k, v in fixed.items())]

    def speed(c: Config, status: str) -> float:
        return reality.outcome(c).tokens_per_s if status == "ok" else 0.0

    seen: dict[tuple[tuple[str, str], ...], tuple[str, float]] = {}

    def trial(c: Config) -> float:
        key = tuple(sorted((k, repr(v)) for k, v in c.items()))
        if key not in seen:
            if search.done:
                return 0.0
            status = search.run(c)
            seen[key] = (status, speed(c, status))
        return seen[key][1]

    def plain(u: dict[str, Any], stage: int, mb: int) -> Config | None:
        """The stage's default knobs: the first choice of each (no offload)."""
        found = matching(**u, zero_stage=stage, micro_batch_size=mb)
        return found[0] if found else None

    stages = sorted({c["zero_stage"] for c in grid if "zero_stage" in c})
    micro_batches = sorted({c["micro_batch_size"] for c in grid})
    for u in settings:
        half = u.get("precision") in ("bf16", "fp16")
        profile = plain(u, max(stages), micro_batches[0])
        if profile is None:
            continue
        trial(profile)
        if seen[tuple(sorted((k, repr(v)) for k, v in profile.items()))][0] != "ok":
            continue  # DeepSpeed: "model info profile run failed": no tuning
        activation = max(
            1.0,
            reality.outcome(profile).peak_bytes
            - instantiation_bytes(n_params, half, max(stages), reality.nproc),
        )
        best_mbs, max_mbs, best_metric = 0, 0, 0.0
        for stage in stages:
            states = instantiation_bytes(n_params, half, stage, reality.nproc)
            if states + activation > reality.budget_bytes:
                continue
            calc_max = int((reality.budget_bytes - states) // activation)
            if calc_max < max_mbs:
                continue
            fast_mbs, fast_metric = 0, 0.0
            for mb in (m for m in micro_batches if m <= max(calc_max, micro_batches[0])):
                c = plain(u, stage, mb)
                if c is None:
                    continue
                metric = trial(c)
                if metric <= 0:
                    break  # OOM: bigger micro-batches would too
                if metric > fast_metric:
                    fast_mbs, fast_metric = mb, metric
            stage_mbs, stage_metric = fast_mbs, fast_metric
            if stage > 0 and not (fast_mbs <= best_mbs or fast_metric < best_metric) and fast_mbs:
                # the stage's knobs, grid-searched with early stopping
                best_here, since = fast_metric, 0
                for n, c in enumerate(matching(**u, zero_stage=stage, micro_batch_size=fast_mbs)):
                    if n >= DS_NUM_TRIALS or since >= DS_EARLY_STOPPING:
                        break
                    metric = trial(c)
                    if metric > best_here:
                        best_here, since = metric, 0
                    else:
                        since += 1
                stage_metric = max(stage_metric, best_here)
            if stage_mbs > best_mbs:
                best_mbs, max_mbs, best_metric = stage_mbs, calc_max, stage_metric
        if search.done:
            break
    return search


#: peers that never repeat a configuration and cost nothing to simulate: searched to the end
EXHAUSTIVE = ("random", "grid", "DeepSpeed-style")
PEERS: dict[str, Callable[[Reality, int, int], Search]] = {
    "autotune": lambda r, seed, cap: study_search(r, strategy("autotune"), seed, cap),
    "TPE (constraints)": lambda r, seed, cap: study_search(r, strategy("tpe"), seed, cap),
    "NSGA-II (constraints)": lambda r, seed, cap: study_search(r, nsga2, seed, cap),
    "random": random_search,
    "grid": lambda r, seed, cap: order_search(r, r.grid, cap),
    "DeepSpeed-style": lambda r, seed, cap: deepspeed_style(r, cap),
}


# --- the realities ------------------------------------------------------------------------------

MEASURED = HERE / "measured_mini_llama.json"
TRACED = HERE / "traced_small_llama.json"
#: the budgets: most of each space over it
MEASURED_BUDGET = 16 * MIB
TRACED_BUDGET = 600 * MIB


def measured(seed: int, budget: float = MEASURED_BUDGET) -> Reality:
    return table_reality(
        "measured: mini-llama (0.9M), real CPU trials",
        MEASURED,
        HERE / "measured_space.yaml",
        budget,
        "real trials on one pinned core of a 2-core CPU, each speed the median of 3 passes "
        "(the other two lie a median 5.0% from it): differences of a few percent are noise; CPU "
        "offload is no PCIe copy; a small model (fixed costs weigh more than on a GPU)",
    )


def traced(seed: int) -> Reality:
    return table_reality(
        "traced: small-llama (58M) on 4x RTX 4090",
        TRACED,
        HERE / "traced_space.yaml",
        TRACED_BUDGET,
        "memory from the traced estimator (fake-tensor step) plus the device model's "
        "construction peak; speed from the roofline the analytical estimator also uses",
        nproc=4,
        backend="cuda",
        gpu="rtx4090",
        hardware=cuda_hardware(4),
    )


def cuda_hardware(n: int) -> Hardware:
    return Hardware(
        backend="cuda",
        cuda_capability=(8, 9),
        gpu_count=n,
        has_flash_attn=True,
        has_bitsandbytes=True,
        has_peft=True,
        has_deepspeed=True,
    )


INTERACTION_MODEL = "llama-7b"
INTERACTION_GPU = "a100-40gb"
INTERACTION_NPROC = 8
INTERACTION_BUDGET = 40 * 10**9


def interaction_space() -> SearchSpace:
    return SearchSpace.load(HERE / "interaction_space.yaml").resolve(
        MODELS[INTERACTION_MODEL].global_batch_size, cuda_hardware(INTERACTION_NPROC)
    )


_PRIOR: dict[Any, tuple[float, float]] = {}


def interaction_prior(c: Config) -> tuple[float, float]:
    """The analytical estimator's (peak, tokens/s) of llama-7b on 8x A100 40GB (cached)."""
    key = tuple(sorted((k, repr(v)) for k, v in c.items()))
    if key not in _PRIOR:
        entry = MODELS[INTERACTION_MODEL]
        e = AnalyticalEstimator().estimate(
            Workload(
                entry.config,
                seq_len_tokens=entry.seq_len,
                global_batch_sequences=entry.global_batch_size,
                processes=INTERACTION_NPROC,
                gpu=gpu_spec(INTERACTION_GPU),
            ),
            c,
        )
        _PRIOR[key] = (float(e.peak_bytes), float(e.tokens_per_s))
    return _PRIOR[key]


def interaction_settings() -> dict[str, Any]:
    entry = MODELS[INTERACTION_MODEL]
    return {
        "model": INTERACTION_MODEL,
        "model_config": entry.config,
        "seq_len": entry.seq_len,
        "global_batch_size": entry.global_batch_size,
        "nproc": INTERACTION_NPROC,
        "gpu": INTERACTION_GPU,
    }


INTERACTION_LIMITS = (
    "synthetic: the analytical model (on the target GPU) times log-normal main effects, "
    "pairwise interaction terms and noise, with 4 crashing pairs of choices per seed"
)


def interactions(seed: int) -> Reality:
    return interaction_reality(
        "interactions: llama-7b on 8x A100 40GB (seed's own draw)",
        interaction_space(),
        interaction_prior,
        INTERACTION_BUDGET,
        seed,
        interaction_settings(),
        INTERACTION_LIMITS,
    )


def misled(seed: int) -> Reality:
    return misled_reality(
        "misled: llama-7b on 8x A100 40GB, a choice the estimator ranks last runs 2.5x faster",
        interaction_space(),
        interaction_prior,
        INTERACTION_BUDGET,
        seed,
        interaction_settings(),
        INTERACTION_LIMITS,
    )


REALITIES: dict[str, Callable[[int], Reality]] = {
    "measured": measured,
    "traced": traced,
    "interactions": interactions,
    "misled": misled,
}


# --- the report ---------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def fmt_trials(n: float, cap: int) -> str:
    return f">{cap}" if n > cap else f"{n:g}"


def fmt_mib(nbytes: float) -> str:
    mib = nbytes / MIB
    return f"{mib:,.0f}" if mib >= 100 else f"{mib:g}"


def fmt_time(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


#: the trials after which the regret is reported: the study's default, and twice it
REGRET_AT = (12, 24)


def regret_after(search: Search, n: int) -> float:
    """1 - (the fastest feasible configuration among the first ``n`` trials) / the optimum."""
    r = search.reality
    best = max(
        (r.outcome(c).tokens_per_s for c, _, _ in search.runs[:n] if r.feasible(c)), default=0.0
    )
    return 1.0 - best / r.optimum_speed


def fmt_regret(xs: list[float]) -> str:
    return f"{100 * statistics.median(xs):.1f}% / {100 * percentile(xs, 0.9):.1f}%"


def summarise(name: str, searches: list[Search], grid: int, cap: int) -> tuple[str, float]:
    counts = [float(s.found_at) if s.found_at else float(cap + 1) for s in searches]
    med, p90 = statistics.median(counts), percentile(counts, 0.9)
    ooms = statistics.median([sum(st == "oom" for _, st, _ in s.spent()) for s in searches])
    fails = statistics.median([sum(st == "failed" for _, st, _ in s.spent()) for s in searches])
    wall = statistics.median([sum(c for _, _, c in s.spent()) for s in searches])
    missed = sum(s.found_at is None for s in searches)
    regrets = " | ".join(fmt_regret([regret_after(s, n) for s in searches]) for n in REGRET_AT)
    row = (
        f"| {name} | {fmt_trials(med, cap)} | {fmt_trials(p90, cap)} | "
        f"{100 * min(med, grid) / grid:.1f}% | {regrets} | {ooms:g} | {fails:g} | "
        f"{fmt_time(wall)} | {missed}/{len(searches)} |"
    )
    return row, med


def tail_seeds(searches: list[Search], cap: int) -> list[str]:
    """The seeds at or beyond the 90th percentile of trials, with what sets them apart: how
    many configurations lie within 2% of the optimum, and the optimum itself."""
    counts = [s.found_at or cap + 1 for s in searches]
    p90 = percentile([float(c) for c in counts], 0.9)
    lines = []
    near = [sum(s.reality.hit(c) for c in s.reality.grid) for s in searches]
    for seed, (s, n, k) in enumerate(zip(searches, counts, near, strict=True)):
        if n >= p90:
            best, _ = s.reality.optimum()
            lines.append(
                f"- seed {seed}: {fmt_trials(n, cap)} trials; {k} configuration(s) within 2% "
                f"of the optimum (median over seeds {statistics.median(near):g}); optimum {best}"
            )
    return lines


def cap_for(peer: str, reality: Reality, cap: int) -> int:
    return len(reality.grid) if peer in EXHAUSTIVE else min(cap, len(reality.grid))


def iterate(
    realities: dict[str, Callable[[int], Reality]], names: list[str], seeds: int
) -> Iterator[tuple[str, int, Reality]]:
    for name in names:
        for seed in range(seeds):
            yield name, seed, realities[name](seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--cap", type=int, default=150, help="most real trials per search")
    parser.add_argument("--realities", default=",".join(REALITIES))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument(
        "--measured-budget",
        type=float,
        default=MEASURED_BUDGET / MIB,
        metavar="MIB",
        help="the measured reality's budget in MiB (its table holds every peak, so any budget "
        "replays)",
    )
    args = parser.parse_args(argv)
    if not args.measured_budget > 0:
        print(f"--measured-budget must be positive, not {args.measured_budget}", file=sys.stderr)
        return 2
    realities: dict[str, Callable[[int], Reality]] = {
        **REALITIES,
        "measured": functools.partial(measured, budget=args.measured_budget * MIB),
    }
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore")
    peers = args.peers.split(",")
    for name in args.realities.split(","):
        if name not in REALITIES:
            print(f"unknown reality '{name}' (known: {', '.join(REALITIES)})", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        results: dict[str, list[Search]] = {p: [] for p in peers}
        first = None
        for _, seed, reality in iterate(realities, [name], args.seeds):
            first = first or reality
            for p in peers:
                results[p].append(PEERS[p](reality, seed, cap_for(p, reality, args.cap)))
        assert first is not None
        cap = min(args.cap, len(first.grid))
        feasible = sum(first.feasible(c) for c in first.grid)
        best, speed = first.optimum()
        print(
            f"\n## {first.name}\n\n{len(first.grid)} configurations, budget "
            f"{fmt_mib(first.budget_bytes)} MiB, {feasible} feasible (seed 0), {args.seeds} "
            f"seeds, cap {cap} trials (random, grid, DeepSpeed-style: none) "
            f"({time.perf_counter() - t0:.0f}s)\n"
            f"optimum (seed 0): {speed:,.0f} tok/s {best}\nlimits: {first.limits}\n"
        )
        print(
            "| peer | median trials | p90 | median % of grid | "
            + " | ".join(f"regret after {n} (median / p90)" for n in REGRET_AT)
            + " | OOMs (median) | crashes (median) | wall-clock (median) | not reached |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        medians = {}
        for p in peers:
            row, med = summarise(p, results[p], len(first.grid), cap_for(p, first, args.cap))
            medians[p] = med
            print(row)
        if "autotune" in medians and len(medians) > 1:
            best_peer = min((m, p) for p, m in medians.items() if p != "autotune")
            print(
                f"\nbest peer: {best_peer[1]} ({best_peer[0]:g}); its median / autotune's: "
                f"{best_peer[0] / medians['autotune']:.2f}x"
            )
        if "autotune" in results:
            print("\nautotune's tail seeds (at or beyond its 90th percentile of trials):")
            print("\n".join(tail_seeds(results["autotune"], cap_for("autotune", first, args.cap))))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
