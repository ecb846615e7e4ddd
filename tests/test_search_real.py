"""autotune's strategy on real CPU trials: it finds the best measured fitting configuration of
a small enumerated space in fewer trials than the space has configurations."""

from __future__ import annotations

from autotune.availability import Hardware
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from autotune.space import SearchSpace
from autotune.strategy import (
    AutotuneSampler,
    Observation,
    analytical_predictor,
    needs_no_less_memory,
)
from tests.conftest import tiny_spec
from trials.job import run_trial

BUDGET = 150_000_000  # micro-batch 8 without checkpointing (~184 MB) does not fit
SPACE = SearchSpace.from_dict(
    {
        "dimensions": {
            "gradient_checkpointing": {"choices": ["off", "full"]},
            "precision": {"choices": ["fp32", "bf16"]},
            "micro_batch_size": {"choices": [1, 2, 8]},
        }
    }
).resolve(8, Hardware(backend="cpu"))


def test_finds_the_best_measured_config_in_fewer_trials_than_the_space() -> None:
    grid = SPACE.grid()
    measured = {}
    for config in grid:  # the ground truth: every configuration, really trained and measured
        result = run_trial(tiny_spec(config, budget=BUDGET))
        assert result.status in ("ok", "oom"), result.error
        measured[tuple(sorted(config.items()))] = result
    fitting = {k: r for k, r in measured.items() if r.status == "ok"}
    assert 0 < len(fitting) < len(grid)  # the budget really cuts the space
    best = max(fitting, key=lambda k: fitting[k].tokens_per_s)

    predict = analytical_predictor(Workload(MODELS["tiny-llama"].config, 64, 8))
    sampler = AutotuneSampler(grid, predict, BUDGET)
    history: list[Observation] = []
    while True:
        plan = sampler.plan(history)
        assert plan is not None, "the whole space was proposed without reaching the best"
        r = measured[tuple(sorted(plan.items()))]
        history.append(Observation(plan, r.status, r.peak_bytes, r.tokens_per_s))
        if tuple(sorted(plan.items())) == best:
            break
    print(f"best {dict(best)} found at trial {len(history)} of {len(grid)}")
    assert len(history) < len(grid)
    # the strategy never proposed a configuration an earlier OOM implied
    for i, o in enumerate(history):
        if o.status == "oom":
            assert not any(
                needs_no_less_memory(later.config, o.config) for later in history[i + 1 :]
            )
