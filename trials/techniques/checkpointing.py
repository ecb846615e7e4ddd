"""Activation (gradient) checkpointing: recompute a decoder layer's activations in backward
instead of keeping them. ``full`` checkpoints every layer, ``selective`` every
``checkpoint_every``-th one; exact (the same math), less memory, more compute.

``checkpoint_save`` makes it selective per op inside each checkpointed layer
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): ``attention`` keeps the
attention kernel's outputs (the most expensive op to recompute at long sequences, axolotl's
default), ``matmuls`` also every matrix multiply's, so backward recomputes only the cheap
pointwise ops and norms (torchtune's op-level policy); ``none`` keeps only the layer's input.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique, When

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.techniques.terms import MemoryStep, SpeedStep


#: ``checkpoint_save`` -> the aten ops whose outputs a checkpointed layer keeps (by op name; the
#: attention kernels as the CPU and CUDA dispatch them)
ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
#: ``_grouped_mm``: transformers 5 runs an MoE layer's experts as one grouped matmul
MATMUL_OPS = ("mm", "addmm", "bmm", "_grouped_mm")
SAVED_OPS: dict[str, tuple[str, ...]] = {
    "none": (),
    "attention": ATTENTION_OPS,
    "matmuls": ATTENTION_OPS + MATMUL_OPS,
}


def saved_ops(config: Config) -> str:
    """The config's ``checkpoint_save`` (``none`` without checkpointing)."""
    if str(config.get("gradient_checkpointing", "off")) == "off":
        return "none"
    return str(config.get("checkpoint_save", "none"))


def _policy(names: tuple[str, ...]) -> Callable[..., Any]:
    """A selective-checkpoint policy: save the outputs of the ``names`` aten ops, recompute the
    rest (PREFER: torch may still save what it must)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_kwargs(config: Config) -> dict[str, Any]:
    """``torch.utils.checkpoint.checkpoint``'s keyword arguments the job passes (non-reentrant;
    with ``checkpoint_save``, the selective-checkpoint context)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    names = SAVED_OPS[saved_ops(config)]
    if names:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _policy(names))
    return kwargs


def _checkpoint_every(k: int) -> Callable[[nn.Module, Config], None]:
    def apply(model: nn.Module, config: Config) -> None:
        every = k or int(config.get("checkpoint_every", 2))
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5
            enable(activation_checkpointing_kwargs=checkpoint_kwargs(config), every_n_layers=every)
        else:  # pragma: no cover - older transformers, every layer only
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

    return apply


def _no_checkpointing(model: nn.Module, config: Config) -> None:
    return None


#: ``selective`` checkpoints every ``checkpoint_every``-th decoder layer (0 = read it from config).
CHECKPOINTING: dict[str, Callable[[nn.Module, Config], None]] = {
    "off": _no_checkpointing,
    "full": _checkpoint_every(1),
    "selective": _checkpoint_every(0),
}


def every_n_layers(config: Config) -> int | None:
    """Checkpointing as transformers' ``every_n_layers`` (None: off), as the trial applies it."""
    ckpt = str(config.get("gradient_checkpointing", "off"))
    if ckpt == "off":
        return None
    return 1 if ckpt == "full" else int(config.get("checkpoint_every", 2))


class Checkpointing(Technique):
    family = "checkpointing"
    traced = True
    knobs = (
        Knob(
            "gradient_checkpointing",
            tuple(CHECKPOINTING),
            baseline="off",
            from_bool=("full", "off"),
            short=lambda v: {"off": "", "full": "ckpt", "selective": "ckpt/sel"}[v],
            # more layers checkpointed, fewer activations kept
            memory_order=lambda v: {"full": 0.0, "selective": 1.0, "off": 2.0}[v],
        ),
        Knob(
            "checkpoint_every", None, short=lambda v: f"k={v}"
        ),  # selective's k (a positive integer)
        Knob(
            "checkpoint_save",
            tuple(SAVED_OPS),
            short=lambda v: "" if v == "none" else f"save={v}",
            # more ops' outputs kept, more memory
            memory_order=lambda v: {"none": 0.0, "attention": 1.0, "matmuls": 2.0}[v],
        ),
    )
    whens = (
        When(
            "checkpoint_every",
            {"gradient_checkpointing": "selective"},
            "the stride of selective checkpointing",
        ),
        When(
            "checkpoint_save",
            {"gradient_checkpointing": ("full", "selective")},
            "the ops a checkpointed layer keeps: there must be checkpointed layers",
        ),
    )

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        CHECKPOINTING[str(config.get("gradient_checkpointing", "off"))](model, config)
        return model

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        every = every_n_layers(config)
        if every is None:
            return {}
        # the trial's checkpointing, every layer or every k-th; a per-op policy is a Python
        # callable (``context_fn``) that no JSON key can carry: the companion names it
        return {
            "activation_checkpointing": True,
            "activation_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": every},
        }

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        # axolotl checkpoints every layer: selective exports as full
        out: dict[str, Any] = {"gradient_checkpointing": every_n_layers(config) is not None}
        save = saved_ops(config)
        if save != "none":  # axolotl's SAC matches op names by substring ("aten::mm")
            names = ["attention"] + (
                ["aten::mm", "aten::addmm", "aten::bmm"] if save == "matmuls" else []
            )
            out["selective_checkpointing"] = {"save": names}
        return out

    def memory(self, step: MemoryStep) -> None:
        # a checkpointed layer keeps its input and, selective per op, the saved ops' outputs;
        # backward recomputes one layer at a time (with autocast's copies of its weights) and
        # holds the checkpointed layers' inputs until their backward
        every = every_n_layers(step.config)
        if every is None:
            return
        layers = step.stats.layers
        step.n_ckpt = layers // every
        step.saved_kept = step.n_ckpt * step.formulas.saved_op_bytes(
            step.stats, step.config, step.length, step.micro
        )
        step.kept = (
            step.n_ckpt * step.stream + step.saved_kept + (layers - step.n_ckpt) * step.per_layer
        )
        step.recompute = step.per_layer + step.layer_weight_cache
        step.bwd_inputs = step.n_ckpt * step.stream

    def kernels(self, step: SpeedStep) -> None:
        # the forward of 1 in ``every`` layers runs again in backward, less the ops whose
        # outputs a checkpointed layer saves (the matmuls, the attention kernel)
        every = every_n_layers(step.config)
        if every is None:
            return
        step.recompute_share = 1 / every
        save = saved_ops(step.config)
        step.recompute_compute = step.recompute_share * (
            (0.0 if save == "matmuls" else step.fwd_mm) + (0.0 if save != "none" else step.attn_fwd)
        )

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "checkpoint_every_n_layers": every_n_layers(config),
            "checkpoint_save_ops": list(SAVED_OPS[saved_ops(config)]) or None,
        }


TECHNIQUE = Checkpointing()
