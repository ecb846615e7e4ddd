"""A technique's own say in "simplest wins", the loss probe, the strategy's loss prior and a CUDA
trial's environment: a technique defined here alone reaches each through the registry."""

from __future__ import annotations

from typing import Any

from autotune.runner import trial_env
from autotune.selector import simplicity
from autotune.strategy import LOSS_RIDGE_DEFAULT, _loss_prior
from tests.conftest import tiny_spec
from trials.techniques import TECHNIQUES, Knob, Technique
from trials.techniques.base import Config


class _Toy(Technique):
    family = "toy_hooks"
    knobs = (
        Knob(
            "toy_hooks",
            ("off", "sharded", "offloaded"),
            baseline="off",
            complexity=lambda v: {"off": (0, 0), "sharded": (2, 0), "offloaded": (2, 1)}[v],
            loss_prior=0.5,
            probe_plain=True,
        ),
    )

    def environment(self, config: Config, inherited: Any) -> dict[str, str]:
        return {"TOY_HOOKS": f"{config.get('toy_hooks')}+{inherited.get('TOY_BASE', '')}"}


def test_simplicity_weighs_a_new_techniques_complexity() -> None:
    with TECHNIQUES.extended(_Toy()):
        # (used, sharding, offloads): ZeRO-2 shards 2, one offload counts 1
        assert simplicity({"toy_hooks": "offloaded"}) == (1, 2, 1)
        assert simplicity({"toy_hooks": "sharded", "zero_stage": 2}) == (2, 4, 0)
        assert simplicity({"zero_stage": 3, "offload_param": "cpu"}) == (2, 3, 1)
    assert simplicity({"zero_stage": 1, "offload_optimizer": "cpu"}) == (2, 1, 1)


def test_the_probe_and_the_loss_prior_read_the_knob() -> None:
    with TECHNIQUES.extended(_Toy()):
        assert TECHNIQUES.probe_plain(8) == {
            "attention": "sdpa",
            "micro_batch_size": 8,
            "toy_hooks": "off",
        }
        assert _loss_prior("toy_hooks") == 0.5
    assert TECHNIQUES.probe_plain(4) == {"attention": "sdpa", "micro_batch_size": 4}
    assert _loss_prior("precision") == 1.0
    assert _loss_prior("optimizer") == LOSS_RIDGE_DEFAULT


def test_a_cuda_trials_environment_comes_from_the_techniques() -> None:
    base = {"TOY_BASE": "kept", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    spec = tiny_spec({"expandable_segments": True, "toy_hooks": "sharded"}, backend="cuda")
    with TECHNIQUES.extended(_Toy()):
        env = trial_env(base, spec)
    assert env["TOY_HOOKS"] == "sharded+kept"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
    cpu = trial_env(base, tiny_spec({"expandable_segments": True}, backend="cpu"))
    assert cpu["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
