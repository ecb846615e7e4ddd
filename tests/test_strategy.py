"""The strategy's logic on synthetic landscapes (the real-trial test is in test_search_real)."""

from __future__ import annotations

import math

import optuna

from autotune.availability import Hardware
from autotune.space import SearchSpace
from autotune.strategy import AutotuneSampler, Observation, needs_no_less_memory

SPACE = SearchSpace.from_dict(
    {
        "dimensions": {
            "gradient_checkpointing": {"choices": ["off", "full", "selective"]},
            "checkpoint_every": {"choices": [2], "when": {"gradient_checkpointing": "selective"}},
            "precision": {"choices": ["fp32", "bf16", "fp16"]},
            "attention": {"choices": ["sdpa", "eager"]},
            "optimizer": {"choices": ["adamw", "adafactor", "lion"]},
            "micro_batch_size": {"choices": [1, 2, 4, 8, 16]},
        },
        "rules": [{"forbid": {"attention": "eager", "micro_batch_size": [16]}}],
        "reference": {"gradient_checkpointing": "full", "micro_batch_size": 1},
    }
).resolve(16, Hardware(backend="cpu"))
GRID = SPACE.grid()
BUDGET = 300e6


def prior(c: dict) -> tuple[float, float]:
    ckpt = {"off": 1.0, "selective": 0.7, "full": 0.4}[c["gradient_checkpointing"]]
    half = 0.8 if c["precision"] != "fp32" else 1.0
    eager = 1.3 if c["attention"] == "eager" else 1.0
    peak = 100e6 + 30e6 * c["micro_batch_size"] * ckpt * half * eager
    speed = 1000 * (1 + 0.1 * math.log2(c["micro_batch_size"])) * (0.75 + 0.25 * ckpt)
    return peak, speed * (1.5 if c["precision"] != "fp32" else 1.0)


def truth(c: dict) -> tuple[float, float]:
    """The prior is 20% low on memory and does not know fp16 has no fast kernels here."""
    peak, speed = prior(c)
    return peak * 1.2, speed / (40 if c["precision"] == "fp16" else 1)


def observe(c: dict) -> Observation:
    peak, speed = truth(c)
    ok = peak <= BUDGET
    return Observation(
        c,
        "ok" if ok else "oom",
        peak if ok else BUDGET,
        speed if ok else 0.0,
        loss_regression=None if not ok else 0.0 if c["optimizer"] == "adamw" else 0.2,
    )


def test_monotone_oom_rule() -> None:
    oom = {"gradient_checkpointing": "selective", "micro_batch_size": 4, "precision": "bf16"}
    assert needs_no_less_memory({**oom, "micro_batch_size": 8}, oom)
    assert needs_no_less_memory({**oom, "gradient_checkpointing": "off"}, oom)
    assert not needs_no_less_memory({**oom, "gradient_checkpointing": "full"}, oom)
    assert not needs_no_less_memory({**oom, "micro_batch_size": 2}, oom)
    assert not needs_no_less_memory({**oom, "precision": "fp32"}, oom)  # not a monotone dim


def test_vectorised_rule_matches_the_plain_one() -> None:
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    for i in range(0, len(GRID), 17):
        mask = sampler._implied_oom(i)
        assert [bool(m) for m in mask] == [needs_no_less_memory(c, GRID[i]) for c in GRID]


def test_never_proposes_what_an_oom_implies() -> None:
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    history: list[Observation] = []
    for _ in range(40):
        plan = sampler.plan(history)
        assert plan is not None
        for o in history:
            assert plan != o.config
            if o.status == "oom":
                assert not needs_no_less_memory(plan, o.config)
        history.append(observe(plan))


def test_finds_the_true_optimum_despite_a_biased_prior() -> None:
    feasible = [c for c in GRID if truth(c)[0] <= BUDGET and c["optimizer"] == "adamw"]
    best = max(feasible, key=lambda c: truth(c)[1])
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    history: list[Observation] = []
    while len(history) < 25:
        plan = sampler.plan(history)
        assert plan is not None
        history.append(observe(plan))
        if plan == best:
            break
    assert history[-1].config == best
    assert len(history) <= 0.1 * len(GRID)
    # fp16 measured slow is measured at most once more (the first fp16 trial may come with
    # other untried choices that share the blame) while faster candidates remain
    assert sum(o.status == "ok" and o.config["precision"] == "fp16" for o in history) <= 2


def test_drives_a_real_optuna_study_and_respects_enqueued_trials() -> None:
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    reference = SPACE.reference_config()
    study.enqueue_trial(SPACE.params_for(reference))

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        config = SPACE.sample(trial.suggest_categorical)  # type: ignore[arg-type]
        o = observe(config)
        trial.set_user_attr("config", config)
        trial.set_user_attr("status", o.status)
        trial.set_user_attr("peak_bytes", o.peak_bytes)
        trial.set_user_attr("tokens_per_s", o.tokens_per_s)
        trial.set_constraint("memory", (o.peak_bytes - BUDGET) / BUDGET if o.status == "ok" else 1)
        trial.set_constraint("loss", (o.loss_regression or 0.0) - 0.02)
        trial.set_user_attr("loss_regression", o.loss_regression)
        return o.tokens_per_s, o.peak_bytes

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=6)
    configs = [t.user_attrs["config"] for t in study.trials]
    assert configs[0] == reference
    assert len({tuple(sorted(c.items())) for c in configs}) == 6  # planned, never repeated
    assert configs[1] == sampler.plan([observe(configs[0])])


def test_loss_blame_goes_to_the_lossy_choice_that_regressed() -> None:
    sampler = AutotuneSampler(GRID, prior, 10 * BUDGET)  # everything fits: only loss matters
    base = {"gradient_checkpointing": "off", "attention": "sdpa", "micro_batch_size": 16}
    history = [  # bf16 only ever measured together with Adafactor, which regressed
        Observation({**base, "precision": "bf16", "optimizer": "adafactor"}, "ok", 1e8, 1e3, 0.22),
        Observation({**base, "precision": "fp32", "optimizer": "adafactor"}, "ok", 1e8, 1e3, 0.22),
    ]
    plan = sampler.plan(history)
    assert plan is not None
    assert plan["optimizer"] != "adafactor"
    # 16-bit is not blamed: the prior's fastest precisions (bf16 and fp16 tie) stay first
    assert plan["precision"] in ("bf16", "fp16")


def test_a_crashing_combination_is_tried_last() -> None:
    """bf16 with eager attention crashes (as flash-attention in fp32 does): after one crash of
    it, and each choice seen running in another combination, no other bf16+eager config is
    proposed while others remain."""
    sampler = AutotuneSampler(GRID, prior, BUDGET)

    def both(c: dict) -> bool:
        return c["precision"] == "bf16" and c["attention"] == "eager"

    history: list[Observation] = []
    crashed = next(c for c in GRID if both(c))
    history.append(Observation(crashed, "failed", 0.0, 0.0))
    for c in (
        next(c for c in GRID if c["precision"] == "bf16" and c["attention"] == "sdpa"),
        next(c for c in GRID if c["precision"] == "fp32" and c["attention"] == "eager"),
    ):
        history.append(Observation(c, "ok", *truth(c)))
    proposed = []
    for _ in range(20):
        c = sampler.plan(history)
        assert c is not None
        proposed.append(c)
        peak, speed = truth(c)
        history.append(Observation(c, "ok" if peak <= BUDGET else "oom", peak, speed))
    assert not any(both(c) for c in proposed)
    # without the crash (the same trials, all ran) bf16+eager is among the first proposals
    history = [Observation(crashed, "ok", *truth(crashed)), *history[1:3]]
    free = []
    for _ in range(20):
        c = sampler.plan(history)
        assert c is not None
        free.append(c)
        peak, speed = truth(c)
        history.append(Observation(c, "ok" if peak <= BUDGET else "oom", peak, speed))
    assert any(both(c) for c in free)
