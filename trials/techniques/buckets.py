"""ZeRO's communication buckets and overlap: the sizes (in elements) of the preallocated reduce
and all-gather buffers, overlapping communication with backward, contiguous gradients; exact."""

from __future__ import annotations

from typing import Any

from trials.techniques.base import Config, Knob, Run, Technique, When
from trials.techniques.zero import zero_stage

#: config key -> the ``zero_optimization`` key it sets, and the stages that use it
ZERO_KNOBS: dict[str, tuple[str, tuple[int, ...]]] = {
    "reduce_bucket_size": ("reduce_bucket_size", (1, 2, 3)),
    "allgather_bucket_size": ("allgather_bucket_size", (1, 2)),
    "overlap_comm": ("overlap_comm", (2, 3)),
    "contiguous_gradients": ("contiguous_gradients", (2, 3)),
}

STAGE3_WORKING_SET = (
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size",
)


class Buckets(Technique):
    family = "buckets"
    knobs = (
        # buckets are preallocated buffers of that many elements
        Knob("reduce_bucket_size", None, memory_order=float, short=lambda v: f"rb={v:.0e}"),
        Knob("allgather_bucket_size", None, memory_order=float, short=lambda v: f"ag={v:.0e}"),
        # overlapping keeps extra buffers in flight
        Knob(
            "overlap_comm",
            (True, False),
            memory_order=float,
            short=lambda v: "overlap" if v else "",
        ),
        Knob("contiguous_gradients", (True, False), short=lambda v: "" if v else "noncontig"),
    )
    whens = (
        When("reduce_bucket_size", {"zero_stage": (1, 2, 3)}, "ZeRO 1-3 reduce in buckets"),
        When("allgather_bucket_size", {"zero_stage": (1, 2)}, "ZeRO 1-2 all-gather in buckets"),
        When("overlap_comm", {"zero_stage": (2, 3)}, "ZeRO 2-3 overlap their communication"),
        When(
            "contiguous_gradients",
            {"zero_stage": (2, 3)},
            "ZeRO 2-3 copy gradients into one buffer",
        ),
    )

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        stage = zero_stage(config)
        zero: dict[str, Any] = {}
        for key, (ds_key, stages) in ZERO_KNOBS.items():
            if stage in stages and key in config:
                value = config[key]
                zero[ds_key] = bool(value) if isinstance(value, bool) else int(value)
        if stage == 3 and "reduce_bucket_size" in config:
            # Stage 3's working set of gathered parameters follows the same knob: with
            # DeepSpeed's defaults (1e9 elements) nothing gathered is released before it is
            # reused in backward, and a model under a billion parameters keeps every layer
            # gathered, as without ZeRO-3.
            for key in STAGE3_WORKING_SET:
                zero[key] = int(config["reduce_bucket_size"])
        return {"zero_optimization": zero} if zero else {}


def reduce_bucket_elements(config: Config, default: int) -> int:
    """The reduce bucket's elements: the config's ``reduce_bucket_size``, else ``default``
    (DeepSpeed's)."""
    from trials.techniques import setting

    return int(setting(config, "reduce_bucket_size", default))


def sets_reduce_bucket(config: Config) -> bool:
    """The config sizes the reduce bucket (stage 3's working set then follows it)."""
    return "reduce_bucket_size" in config


def contiguous_gradients(config: Config) -> bool:
    """Gradients copied into one buffer (DeepSpeed's default: on)."""
    from trials.techniques import setting

    return bool(setting(config, "contiguous_gradients", True))


def overlaps_comm(config: Config) -> bool:
    """Communication overlapped with backward (DeepSpeed's default: off)."""
    from trials.techniques import setting

    return bool(setting(config, "overlap_comm", False))


TECHNIQUE = Buckets()
