"""Optimizer step in backward: each parameter is updated as soon as its gradient is complete, and
its gradient freed, so the model's gradients never exist all at once.

Each trainable parameter gets an optimizer of its own, stepped by the parameter's
``register_post_accumulate_grad_hook`` (PyTorch's "optimizer step in backward" recipe,
torchtune's ``optimizer_in_bwd``). AdamW, Adafactor and Lion update each parameter from its own
gradient and state alone, so the numbers are the plain step's (exact). What it rules out, in
the space: gradient accumulation (a gradient must be complete before the step: the micro-batch
is the whole batch, ``Knob.whole_batch_only``), fp16's loss scaler (it unscales and checks every
gradient before any step) and DeepSpeed, which owns the optimizer step (``zero_stage`` exists
only without it). With several processes the hook all-reduces its parameter's gradient before
the step (DistributedDataParallel's buckets would reduce after the hooks ran).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Forbid, Knob, Run, Technique, When

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.techniques.terms import MemoryStep, SpeedStep

#: launches per parameter tensor when each tensor is stepped alone (torch's single-tensor
#: AdamW: about 12 ops each)
SINGLE_TENSOR_STEP_OPS = 12


def steps_in_backward(config: Config) -> bool:
    return bool(config.get("optimizer_in_backward", False))


class InBackward:
    """One optimizer per parameter, each stepped by its parameter's post-accumulate-grad hook.

    ``make(params)`` builds an optimizer over a list of parameters; ``step(optimizer)`` runs its
    step (the traced estimator passes one that works on fake tensors); ``world`` > 1 averages
    each gradient over the processes before its step; ``seen(grad)`` is called with each
    complete gradient before its step (the memory trackers tag it)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        step: Callable[[torch.optim.Optimizer], None] | None = None,
        world: int = 1,
        seen: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self.world = world
        self._step = step or (lambda optimizer: optimizer.step())
        self._seen = seen
        for p in params:
            optimizer = make([p])
            self.optimizers.append(optimizer)
            p.register_post_accumulate_grad_hook(self._hook(optimizer))

    def _hook(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step(p: torch.Tensor) -> None:
            if self.world > 1:
                import torch.distributed as dist

                # summed, then averaged: gloo has no AVG (DistributedDataParallel divides too)
                dist.all_reduce(p.grad)  # type: ignore[arg-type]
                p.grad.div_(self.world)  # type: ignore[union-attr]
            if self._seen is not None and p.grad is not None:
                self._seen(p.grad)
            self._step(optimizer)
            optimizer.zero_grad(set_to_none=True)

        return step

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor in the optimizers' per-parameter states."""
        import torch

        return [
            v
            for optimizer in self.optimizers
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]


class OptimizerInBackward(Technique):
    family = "optimizer_in_backward"
    traced = False  # the traced step builds its own optimizers (``InBackward`` there too)
    knobs = (
        Knob(
            "optimizer_in_backward",
            (False, True),
            baseline=False,
            # stepped in backward: gradients freed one by one, never all held
            memory_order=lambda v: 0.0 if v else 1.0,
            whole_batch_only=(True,),
            short=lambda v: "opt-in-bwd" if v else "",
        ),
    )
    #: the engines that own the optimizer step exist only without it
    whens = (
        When("fsdp", {"optimizer_in_backward": False}, "FSDP2 steps its shards itself"),
        When(
            "zero_stage",
            {"optimizer_in_backward": False},
            "optimizer_in_backward runs without DeepSpeed, which owns the step",
            job=True,
        ),
    )
    forbids = (
        Forbid(
            {"precision": "fp16", "optimizer_in_backward": True},
            "optimizer_in_backward runs without fp16's loss scaler, which unscales and checks "
            "every gradient before any step",
            job=True,
        ),
    )

    def moments(self, step: MemoryStep) -> None:
        # each parameter stepped as its gradient completes, and the gradient freed: no moment
        # holds every gradient. The output layer's (the largest) is stepped first, once the
        # logits' gradients are gone and every kept activation still is; in the first layer's
        # backward one MLP matrix's at most; the embedding's after the layers (DeepSpeed owns
        # its step: not there)
        if not steps_in_backward(step.config) or step.deepspeed:
            return
        st = step.stats
        one_grad = min(step.grads, step.gbytes * step.largest)
        matrix = min(one_grad, step.gbytes * st.hidden * st.intermediate)
        del step.moments["optimizer step"], step.moments["end of backward"]
        # the head's 16-bit weight copy (autocast's, saved for its input's gradient) is freed
        # with the head's backward, before its step
        head_cache = (
            2 * step.head_params * (st.layers - step.n_ckpt) // st.layers
            if step.weight_cache
            else 0
        )
        head_acts_cache = step.acts + max(0, step.cache_in_bwd - head_cache)
        step.moments["output layer's step"] = (one_grad, head_acts_cache, 0, step.step_temps)
        step.moments["first layer's backward"] = (matrix, step.bwd_layers, 0, 2 * matrix)
        step.moments["end of backward"] = (one_grad, 0, 0, step.step_temps)

    def kernels(self, step: SpeedStep) -> None:
        if steps_in_backward(step.config):  # every tensor stepped alone, as it completes
            step.per_tensor_ops = max(step.per_tensor_ops, SINGLE_TENSOR_STEP_OPS)

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        # neither TrainingArguments, accelerate nor axolotl has a key for it: the training
        # script reads it here (torchtune's recipes call it ``optimizer_in_bwd``)
        return {"optimizer_in_backward": steps_in_backward(config)}


TECHNIQUE = OptimizerInBackward()
