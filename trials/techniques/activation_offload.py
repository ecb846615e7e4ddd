"""Activation offloading: what backward needs is kept in host memory between forward and backward.

Every tensor autograd saves during the model's forward (``saved_tensors_hooks``) is copied to the
host and the device copy dropped; backward copies each back when its node runs, so the device
holds one node's worth at a time. Under activation checkpointing what autograd saves outside the
checkpointed regions is each region's input (``torch.utils.checkpoint`` saves it through the same
hooks), so the device keeps no layer input at all and only the layer being recomputed: the
pairing torchtune and axolotl use (axolotl refuses offloading without checkpointing), and the only
one searched here (without checkpointing every activation would cross PCIe twice).

Parameters and tensors under ``MIN_BYTES`` stay where they are (torchtune's
``OffloadActivations`` rule). On CUDA the copies go to pinned host memory on the compute stream
(``torch.autograd.graph.save_on_cpu``'s scheme: no overlap, the estimator's speed model charges
the transfers in full); on the CPU backend the copy is made under ``trials.memory.host_memory()``,
so the tracker counts it as host memory, as the GPU would. Exact: the same numbers, moved.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique, When

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.techniques.terms import MemoryStep, SpeedStep

#: smaller saved tensors stay on the device (torchtune's ``min_offload_size``)
MIN_BYTES = 1024


#: how activation offloading copies: "compute" (on the compute stream, as ``save_on_cpu`` and
#: the trial job's hooks do: not overlapped) or "side" (torchtune's ``OffloadActivations`` with
#: ``use_streams``: overlapped with compute, exposed only beyond it); a configuration may name it
#: as ``activation_offload_stream`` (the trial job's is "compute")
OFFLOAD_STREAM_DEFAULT = "compute"


def offloads_activations(config: Config) -> bool:
    checkpointed = str(config.get("gradient_checkpointing", "off")) != "off"
    return checkpointed and str(config.get("activation_offload", "none")) == "cpu"


class _Saved:
    """One offloaded tensor: its device, its host copy, and (weakly) the device copy backward
    made of it, which every node unpacking it while it lives shares."""

    __slots__ = ("__weakref__", "back", "device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor) -> None:
        self.device = device
        self.host = host
        self.back: weakref.ref[torch.Tensor] | None = None


def _copy_to_host(t: torch.Tensor) -> _Saved:
    import torch

    from trials.memory import host_memory

    pinned = t.device.type == "cuda"
    with torch.no_grad(), host_memory():
        # the same strides (a transposed weight stays transposed): backward then runs the same
        # kernels on it, so even 16-bit gradients come out bit for bit (torchtune's rule)
        host = torch.empty_like(t, device="cpu", pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
    return _Saved(t.device, host)


def _unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        return saved  # kept where it was
    back = saved.back() if saved.back is not None else None
    if back is None:
        if saved.device.type == "cpu":  # the CPU backend: a device copy the tracker counts
            back = saved.host.clone()
        else:
            back = saved.host.to(saved.device, non_blocking=True)
        saved.back = weakref.ref(back)
    return back


class _Offloader:
    """The saved-tensor hooks, entered when the model's forward starts and left when its output
    layer starts (what the head and the loss save is used first in backward: moving it out and
    straight back would only cost, the rule TRL's offloading context follows) or when forward
    ends, whichever comes first.

    A tensor saved by several ops (a norm's output feeds q, k and v) is copied once: the copies
    made during one forward are found again by storage and view."""

    def __init__(self) -> None:
        from torch.autograd.graph import saved_tensors_hooks

        self.hooks = saved_tensors_hooks(self.pack, _unpack)
        self.active = False
        #: id(storage) -> [(the storage, weakly; the view's geometry; its copy)], this forward
        self.copies: dict[int, list[tuple[Any, tuple[Any, ...], _Saved]]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        from torch import nn

        if isinstance(t, nn.Parameter) or t.numel() * t.element_size() < MIN_BYTES:
            return t
        storage = t.untyped_storage()
        view = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        for ref, geometry, saved in self.copies.get(id(storage), []):
            if ref() is storage and geometry == view:
                return saved
        saved = _copy_to_host(t)
        self.copies.setdefault(id(storage), []).append((weakref.ref(storage), view, saved))
        return saved

    def start(self, *_: Any) -> None:
        if not self.active:
            self.copies.clear()
            self.hooks.__enter__()
            self.active = True

    def stop(self, *_: Any) -> None:
        if self.active:
            self.hooks.__exit__(None, None, None)
            self.active = False
            self.copies.clear()


def offload_activations(model: nn.Module) -> nn.Module:
    """Offload what autograd saves during each forward of ``model`` up to its output layer (in
    place, with hooks: the one that ends it runs even when forward raises)."""
    offloader = _Offloader()
    model.register_forward_pre_hook(offloader.start)
    model.register_forward_hook(offloader.stop, always_call=True)
    head = model.get_output_embeddings()  # type: ignore[operator]
    if head is not None:
        head.register_forward_pre_hook(offloader.stop)
    return model


class ActivationOffload(Technique):
    family = "activation_offload"
    traced = True
    knobs = (
        Knob(
            "activation_offload",
            ("none", "cpu"),
            baseline="none",
            memory_order=lambda v: {"cpu": 0.0, "none": 1.0}[v],  # offloaded: less on the device
            short=lambda v: "" if v == "none" else "act-off",
        ),
    )
    whens = (
        When(
            "activation_offload",
            {"gradient_checkpointing": "full"},
            "searched with full checkpointing only, as torchtune pairs them (without it every "
            "activation would cross PCIe twice)",
        ),
    )

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        return offload_activations(model) if offloads_activations(config) else model

    def memory(self, step: MemoryStep) -> None:
        # what the layers save goes to the host, up to the output layer (with the final norm's
        # saved tensors; the head's input stays), and backward brings one layer back at a time
        # (with its recompute); per-op checkpointing's saved ops stay in the checkpoint's own
        # store, and autocast's cast cache still holds the weight copies the layers save (their
        # host copies are extra)
        if not offloads_activations(step.config):
            return
        host = step.kept - step.saved_kept + step.final_norm
        if step.half and not step.model16 and not step.quantized:
            host += 2 * step.layer_linear * (step.stats.layers - step.n_ckpt)
        step.host_acts += host
        step.kept = step.saved_kept
        step.head_on_host = step.final_norm
        step.bwd_inputs = step.stream

    def speed(self, step: SpeedStep) -> None:
        # the offloaded bytes out in forward, back in backward, every micro-batch, on the
        # compute stream (or, on a side stream, behind the forward's and the backward's compute)
        moved = step.offloaded_activations / step.pcie
        if str(step.config.get("activation_offload_stream", OFFLOAD_STREAM_DEFAULT)) == "side":
            exposed = max(0.0, moved - step.fwd_all) + max(0.0, moved - step.bwd)
            step.activation_copies = step.accum * exposed
        else:
            step.activation_copies = step.accum * 2 * moved

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        if not offloads_activations(config):
            return {}
        # axolotl's "hidden_states" offloads the checkpointed layers' inputs (with its selective
        # per-op checkpointing the only mode it accepts); true is TRL's offloader of every saved
        # tensor, which is what happens here besides under every-k-th-layer checkpointing
        full = str(config.get("gradient_checkpointing")) == "full"
        per_op = str(config.get("checkpoint_save", "none")) != "none"
        return {"activation_offloading": "hidden_states" if full or per_op else True}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "activation_offload": "cpu" if offloads_activations(config) else None,
            "activation_offload_min_bytes": MIN_BYTES if offloads_activations(config) else None,
        }


TECHNIQUE = ActivationOffload()
