"""ZeRO through the real DeepSpeed engine: ``zero_stage`` 0-3 shards optimizer states (1),
gradients (2) and parameters (3) over the ranks; exact. Stage 0 is DeepSpeed without sharding.
A config with a ``zero_stage`` runs the DeepSpeed engine (``trials.engines``); the DeepSpeed JSON
is built in ``trials.deepspeed_engine.deepspeed_config`` from every technique's ``deepspeed``
part."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique

if TYPE_CHECKING:
    from trials.techniques.terms import MemoryStep, SpeedStep, TraceStep


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
    untraced = ("zero_stage",)  # by formula beside the trace
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

    def model_in_16_bits(self, config: Config) -> bool:
        return runs_deepspeed(config)  # DeepSpeed's engine keeps a 16-bit model, any stage

    def operators(self, step: SpeedStep) -> None:
        # stages 1-3 step this rank's shard of the states, over DeepSpeed's flat partitions,
        # and write the 16-bit copy of the updated weights
        if zero_stage(step.config) < 1:
            return
        step.trainable = step.stats.n_params // step.nproc
        step.flat_partitions = True
        if step.half:
            step.step_bytes += 2

    def speed(self, step: SpeedStep) -> None:
        # communication over the GPUs' link, ring algorithms: stage 0 (and data parallelism
        # without DeepSpeed) all-reduces fp32 gradients once per step, overlapped with
        # backward; stages 1-2 reduce-scatter 16-bit gradients each micro-batch (overlapped
        # with backward) and all-gather the updated weights after the step; stage 3 gathers
        # the weights in forward and in backward and reduce-scatters gradients per
        # micro-batch, prefetched (overlapped with compute)
        n = step.nproc
        if n <= 1:
            return
        stage = zero_stage(step.config)
        ring = (n - 1) / n
        psi, link, bwd = step.stats.n_params, step.link, step.bwd
        if stage == 0:
            step.comm_step = max(0.0, 2 * ring * 4 * psi / link - bwd)
        elif stage in (1, 2):
            reduce = ring * step.wbytes * psi / link
            step.comm_micro_exposed = max(0.0, reduce - bwd) if stage == 2 else 0.0
            step.comm_step = ring * step.wbytes * psi / link + (reduce if stage == 1 else 0.0)
        else:
            gather = ring * step.wbytes * psi / link
            step.comm_micro_exposed = max(0.0, gather - step.fwd_all) + max(0.0, 2 * gather - bwd)

    def moments(self, step: MemoryStep) -> None:
        # ZeRO 1-2 make the gradient bucket at the output layer's gradient hook, once the
        # logits' gradients are gone and every kept activation still is (under stage 3 the
        # moment holds what the start of backward does, less the logits), and reduce at the
        # accumulation boundary once backward is over (its own buffers); ZeRO-2 under offload
        # also where the gradients first overflow the bucket, with the activations of the
        # layers whose backward is still to come. What a rank holds in each phase: DeepSpeed's
        # (``zero_states_at``)
        phases = step.states.phases
        if phases is None:
            return
        layer_acts = step.acts + step.cache_in_bwd
        step.moments["first gradient hook"] = (step.grads_before, layer_acts, 0, 0)
        step.moments["accumulation boundary"] = (step.grads, 0, 0, 0)
        if phases.overflow:
            held_acts = int(layer_acts * phases.overflow_held)
            step.moments["bucket overflow"] = (step.grads_before, held_acts, 0, 0)

        def held(moment: str) -> dict[str, int]:
            return step.formulas.zero_states_at(phases, moment, step.accum)

        step.held = held

    def traced_states(self, step: TraceStep) -> None:
        # the trace ran one unsharded process. Its activations and logits stay; the model
        # states are what DeepSpeed holds during the backward pass (the formula's), unless the
        # end of backward (its buffers of the backward pass) or the optimizer step, with no
        # activation left, hold more
        phases = step.states.phases
        if phases is None:
            return
        step.taken = True
        at, accum = step.formulas.zero_states_at, step.accum
        peak, breakdown = step.net()
        held = at(phases, "start of backward", accum)
        # at the first gradient hook, what fires it (and ZeRO 1-2's bucket) beside what the
        # trace held then; from then on, the bucket beside the trace's later peak
        for prefix, moment in (
            ("first_hook:", "first gradient hook"),
            ("hook:", "after the first gradient hook"),
        ):
            hook_peak, hook = step.net(prefix)
            hooked = at(phases, moment, accum)
            if hook_peak + sum(hooked.values()) > peak + sum(held.values()):
                peak, breakdown, held = hook_peak, hook, hooked
        if phases.overflow:
            # ZeRO-2 under offload: the first reduction in backward, with what the trace held
            # at the first hook scaled to the layers whose backward is still to come
            held_share = phases.overflow_held
            hook_peak, hook = step.net("first_hook:")
            over = at(phases, "bucket overflow", accum)
            if int(hook_peak * held_share) + sum(over.values()) > peak + sum(held.values()):
                breakdown = {k: int(v * held_share) for k, v in hook.items()}
                peak, held = sum(breakdown.values()), over
        stateful = [
            at(phases, moment, accum)
            for moment in ("end of backward", "accumulation boundary", "optimizer step")
        ]
        alone = max(stateful, key=lambda part: sum(part.values()))
        if sum(alone.values()) > peak + sum(held.values()):
            peak, breakdown = sum(alone.values()), dict.fromkeys(step.roles, 0)
            breakdown.update(alone)
        else:
            peak += sum(held.values())
            breakdown["temporaries"] += held.pop("temporaries")
            breakdown.update(held)
        step.peak, step.breakdown = peak, {k: breakdown.get(k, 0) for k in step.roles}


TECHNIQUE = Zero()
