"""ZeRO through the real DeepSpeed engine: ``zero_stage`` 0-3 shards optimizer states (1),
gradients (2) and parameters (3) over the ranks; exact. Stage 0 is DeepSpeed without sharding.
A config with a ``zero_stage`` runs the DeepSpeed engine (``trials.engines``); the DeepSpeed JSON
is built in ``trials.zero.deepspeed_config`` from every technique's ``deepspeed`` part."""

from __future__ import annotations

from typing import Any

from trials.techniques.base import Config, Knob, Run, Technique


def runs_deepspeed(config: Config) -> bool:
    """Whether the trial runs the DeepSpeed engine (any ``zero_stage``, 0 included)."""
    return "zero_stage" in config


def zero_stage(config: Config) -> int:
    return int(config.get("zero_stage", 0) or 0)


def partitions_params(config: Config) -> bool:
    """ZeRO-3: the parameters partitioned too (built under ``deepspeed.zero.Init``)."""
    return runs_deepspeed(config) and zero_stage(config) == 3


class Zero(Technique):
    family = "zero"
    knobs = (
        Knob(
            "zero_stage",
            (0, 1, 2, 3),
            baseline=0,
            short=lambda v: f"zero{v}" if v else "",
            complexity=lambda v: (int(v or 0), 0),  # a higher stage shards more
        ),
    )

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        return {"zero_optimization": {"stage": zero_stage(config)}}


TECHNIQUE = Zero()
