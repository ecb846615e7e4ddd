"""Training engines: what one optimizer step means, behind one interface.

``torch``: the model as built, torch autocast/GradScaler and the optimizer of the config;
``DistributedDataParallel`` when torchrun started several ranks. ``deepspeed``: the real
DeepSpeed engine with the config ``trials.deepspeed_engine.deepspeed_config`` builds (any ZeRO
stage, offload). The trial job picks the row from the config (``engine_for``); no ``if`` chains.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from trials.build import build_model
from trials.cuda import scaler_skipped
from trials.data import Batch
from trials.deepspeed_engine import (
    deepspeed_config,
    device_buffers,
    ensure_distributed,
    gathered,
    offloaded_tensors,
    zero3_init,
    zero_roles,
)
from trials.memory import MemoryMonitor, plain_tensors
from trials.spec import TrialSpec
from trials.techniques import OPTIMIZERS, PRECISIONS, TECHNIQUES, Run
from trials.techniques.attention import attn_implementation
from trials.techniques.fsdp import offloads_shards, runs_fsdp, shard
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.offload import offloads_optimizer, offloads_params
from trials.techniques.optimizer import DS_OPTIMIZERS, optimizer_factory, optimizer_of
from trials.techniques.optimizer_in_backward import InBackward, steps_in_backward
from trials.techniques.precision import model_dtype, precision_of, pure_bf16, weight_dtype
from trials.techniques.zero import partitions_params, runs_deepspeed


def world() -> tuple[int, int]:
    """(rank, world size) of this job: torchrun's, or (0, 1) alone."""
    import os

    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def trial_deepspeed_config(spec: TrialSpec) -> dict[str, Any]:
    """The DeepSpeed JSON of this trial (this world's ranks, the spec's micro-batch)."""
    micro, accum = micro_and_accumulation(spec.config, spec.global_batch_size)
    return deepspeed_config(spec.config, Run(micro, accum, world()[1], spec.backend, spec.lr))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's per-parameter state (moments, step counters)."""
    return [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


class Engine(ABC):
    """Wraps a built model; ``step`` runs one optimizer step over the rank's micro-batches.

    ``build`` makes the model the way this engine trains it (``trials.build``), so construction
    never needs more memory than the steps. ``skipped`` counts optimizer steps the fp16 loss
    scaler skipped (their tokens did not train the model)."""

    skipped = 0

    @classmethod
    def build(cls, spec: TrialSpec, device: torch.device, monitor: MemoryMonitor) -> nn.Module:
        """fp32 weights on the device: autocast trains over fp32 master weights; bf16 in pure
        bf16 (no master copy, no autocast)."""
        with device:
            return build_model(
                spec.model_config,
                attn_implementation(spec.config),
                spec.seed,
                dtype=model_dtype(spec.config),
                weights=spec.weights,
            )

    def __init__(
        self, model: nn.Module, spec: TrialSpec, device: torch.device, monitor: MemoryMonitor
    ) -> None:
        self.spec = spec
        self.device = device
        self.monitor = monitor
        self.micro, self.accum = micro_and_accumulation(spec.config, spec.global_batch_size)
        self.rank, self.world = world()
        # what the techniques' rules say cannot run (the search never proposes it; a config
        # given by hand is refused here with the rule's reason)
        refused = TECHNIQUES.refusal(spec.config, self.accum)
        if refused is not None:
            raise ValueError(refused)

    @abstractmethod
    def step(self, batches: list[Batch]) -> float:
        """Train on this rank's micro-batches (``trials.data.step_batches``); return the
        step's mean loss (this rank's share of it, times the ranks)."""

    @abstractmethod
    def breakdown(self, peak: int) -> dict[str, int]: ...


class TorchEngine(Engine):
    def __init__(
        self, model: nn.Module, spec: TrialSpec, device: torch.device, monitor: MemoryMonitor
    ) -> None:
        super().__init__(model, spec, device, monitor)
        cfg = spec.config
        self.model = model
        in_backward = steps_in_backward(cfg)
        self.model = self.wrap(model, in_backward)
        trainable = [p for p in model.parameters() if p.requires_grad]
        factory = optimizer_factory(cfg)
        precision = PRECISIONS[precision_of(cfg)]
        # pure bf16: the model itself is bf16, nothing to autocast
        plain = self.sharded or pure_bf16(cfg)
        self.autocast_dtype = None if plain else precision.autocast_dtype
        self.scaler = torch.amp.GradScaler(device.type) if precision.loss_scaling else None
        self.optimizer: torch.optim.Optimizer | None = None
        self.in_backward: InBackward | None = None
        if in_backward:
            self.in_backward = InBackward(
                trainable,
                lambda ps: factory(ps, spec.lr),
                world=self.world,
                seen=lambda grad: monitor.tag("gradients", grad),
            )
        else:
            self.optimizer = factory(trainable, spec.lr)
        monitor.tag("parameters", *model.parameters())

    #: FSDP2 casts the parameters itself (its mixed-precision policy): no autocast on top
    sharded = False

    def wrap(self, model: nn.Module, in_backward: bool) -> nn.Module:
        """DistributedDataParallel over several ranks (unless each step-in-backward hook
        reduces its own gradient)."""
        if self.world == 1:
            return model
        ensure_distributed(self.spec.backend, deepspeed_comm=False)
        if in_backward:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, batches: list[Batch]) -> float:
        total = 0.0
        for batch in batches:
            with self._autocast():
                loss = batch.scaled(self.model(**batch.inputs()).loss)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            total += float(loss.detach())
            del loss
        if self.optimizer is None:  # stepped in backward, parameter by parameter
            self.monitor.tag("optimizer_states", *self._state_tensors())
            return total
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.monitor.tag("gradients", *grads)
        self.gradients_ready(grads)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skipped += scaler_skipped(scale, self.scaler.get_scale())
        else:
            self.optimizer.step()
        self.monitor.tag("optimizer_states", *self._state_tensors())
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def gradients_ready(self, grads: list[torch.Tensor]) -> None:
        """Called with this step's gradients before the optimizer steps."""

    def _state_tensors(self) -> list[torch.Tensor]:
        if self.in_backward is not None:
            return self.in_backward.state_tensors()
        assert self.optimizer is not None
        return optimizer_state_tensors(self.optimizer)

    def breakdown(self, peak: int) -> dict[str, int]:
        """Where the monitor does not attribute storages (CUDA): sizes of the model states,
        the rest of the peak as activations and other."""
        params = _nbytes(self.model.parameters())  # FSDP2: this rank's shards
        states = _nbytes(self._state_tensors())
        # freed by zero_grad; at the peak they exist in full precision (stepped in backward:
        # one parameter's at a time)
        grads = params if self.in_backward is None else 0
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_states": states,
            "activations_and_other": max(0, peak - params - grads - states),
        }


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this process holds for these tensors (a DTensor: its local shard)."""
    return sum(t.numel() * t.element_size() for outer in tensors for t in plain_tensors(outer))


class FsdpEngine(TorchEngine):
    """FSDP2 (``trials.techniques.fsdp``): ``fully_shard`` on each block and the root, the
    torch loop and optimizer on the sharded (DTensor) parameters. The model is built whole in
    host memory and sharded onto the device block by block, so the device never holds it whole.
    On the CPU backend what ``CPUOffloadPolicy`` keeps on the host (the shards, their gradients,
    the optimizer's states) is counted as host memory."""

    sharded = True

    @classmethod
    def build(cls, spec: TrialSpec, device: torch.device, monitor: MemoryMonitor) -> nn.Module:
        with monitor.host_allocations(), torch.device("cpu"):
            return build_model(
                spec.model_config,
                attn_implementation(spec.config),
                spec.seed,
                dtype=model_dtype(spec.config),
                weights=spec.weights,
            )

    def wrap(self, model: nn.Module, in_backward: bool) -> nn.Module:
        ensure_distributed(self.spec.backend, deepspeed_comm=False)
        # offloaded, the shards are host memory from birth (CPUOffloadPolicy makes them there;
        # on the CPU backend the tracker must not count them against the device while they are
        # made: a scale replica's construction ran out of its budget so)
        offloaded = offloads_shards(self.spec.config)
        with self.monitor.host_allocations() if offloaded else nullcontext():
            return shard(model, self.spec.config, self.device, self.world)

    def step(self, batches: list[Batch]) -> float:
        if not offloads_shards(self.spec.config):
            return super().step(batches)
        # the shards' gradients and the optimizer's states appear in the step, before they can
        # be marked as host memory: the budget is checked on the step's corrected peak
        with self.monitor.deferred_budget():
            total = super().step(batches)
            self._mark_offloaded(self._state_tensors())
        return total

    def gradients_ready(self, grads: list[torch.Tensor]) -> None:
        if offloads_shards(self.spec.config):
            self._mark_offloaded(grads)

    def _mark_offloaded(self, tensors: list[torch.Tensor]) -> None:
        if self.device.type == "cpu":  # on CUDA they are host tensors already
            self.monitor.mark_host(*self.model.parameters(), *tensors)


class DeepSpeedEngine(Engine):
    """``deepspeed.initialize`` with the trial's generated config; DeepSpeed owns accumulation
    (``engine.backward`` scales by 1/accumulation, ``engine.step`` steps at the boundary)."""

    @classmethod
    def build(cls, spec: TrialSpec, device: torch.device, monitor: MemoryMonitor) -> nn.Module:
        """In DeepSpeed's weight dtype; ZeRO-3: partitioned layer by layer under zero.Init."""
        cfg = spec.config
        attention = attn_implementation(cfg)
        dtype = weight_dtype(precision_of(cfg))
        if not partitions_params(cfg):
            with device:
                return build_model(
                    spec.model_config, attention, spec.seed, dtype=dtype, weights=spec.weights
                )
        ensure_distributed(spec.backend, deepspeed_comm=True)
        return build_model(
            spec.model_config,
            attention,
            spec.seed,
            dtype=dtype,
            init_context=zero3_init(trial_deepspeed_config(spec), monitor.host_allocations),
            gather=gathered,
            weights=spec.weights,
        )

    def __init__(
        self, model: nn.Module, spec: TrialSpec, device: torch.device, monitor: MemoryMonitor
    ) -> None:
        super().__init__(model, spec, device, monitor)
        import deepspeed

        cfg = spec.config
        ensure_distributed(spec.backend, deepspeed_comm=True)
        self.rank, self.world = world()
        self.ds_config = trial_deepspeed_config(spec)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer_name = optimizer_of(cfg)
        client = (
            None
            if optimizer_name in DS_OPTIMIZERS
            else OPTIMIZERS[optimizer_name].factory(trainable, spec.lr)
        )
        # offloaded buffers are made before they can be marked as host: the budget is checked
        # on the corrected peak once they are
        # With offload_param, DeepSpeed's ZeRO-3 setup builds the model-sized flat buffers (and
        # transient copies of them) in host memory: on the CPU backend its allocations count as
        # host, except its device reduce bucket, handed back to the device count after.
        host = monitor.host_allocations() if offloads_params(cfg) else nullcontext()
        with monitor.deferred_budget():
            with host:
                self.engine, self.optimizer, _, _ = deepspeed.initialize(
                    model=model, model_parameters=trainable, optimizer=client, config=self.ds_config
                )
            if offloads_params(cfg):
                monitor.mark_device(*device_buffers(self.optimizer))
            self.model = model
            self._mark_offloaded()
        self._tag_roles()

    def _mark_offloaded(self) -> None:
        self.monitor.mark_host(*offloaded_tensors(self.optimizer, self.model, self.spec.config))

    def _tag_roles(self) -> None:
        for role, tensors in zero_roles(self.optimizer, self.model).items():
            self.monitor.tag(role, *tensors)

    def step(self, batches: list[Batch]) -> float:
        # with offload, the optimizer's host states appear in the first step, before they can
        # be marked: the budget is then checked on the step's corrected peak
        offloads = offloads_optimizer(self.spec.config) or offloads_params(self.spec.config)
        with self.monitor.deferred_budget() if offloads else nullcontext():
            return self._step(batches)

    def _step(self, batches: list[Batch]) -> float:
        total = 0.0
        for batch in batches:
            # DeepSpeed divides by the accumulation itself: the share times it (1 when the
            # micro-batches are equal)
            loss = batch.scaled(self.engine(**batch.inputs()).loss, by=self.accum)
            self.engine.backward(loss)  # scaled by 1/accumulation inside
            self._tag_roles()  # gradients live until the step
            self.engine.step()  # the optimizer steps at the accumulation boundary only
            total += float(loss.detach()) / self.accum
            del loss
        self.skipped = int(getattr(self.engine, "skipped_steps", 0))  # fp16 overflow steps
        self._mark_offloaded()  # optimizer states appear at the first step
        self._tag_roles()
        return total

    def breakdown(self, peak: int) -> dict[str, int]:
        """Where the monitor does not attribute storages (CUDA): the sizes of DeepSpeed's
        parameter and optimizer-state buffers, the rest of the peak as activations and other."""
        sizes: dict[str, int] = {}
        seen: set[int] = set()
        for role in ("parameters", "optimizer_states"):
            sizes[role] = 0
            for t in zero_roles(self.optimizer, self.model)[role]:
                if t.device.type == self.device.type and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    sizes[role] += t.untyped_storage().nbytes()
        sizes["activations_and_other"] = max(0, peak - sum(sizes.values()))
        return sizes


ENGINES: dict[str, type[Engine]] = {
    "torch": TorchEngine,
    "fsdp": FsdpEngine,
    "deepspeed": DeepSpeedEngine,
}


def engine_for(config: dict[str, Any]) -> str:
    if runs_fsdp(config):
        return "fsdp"
    return "deepspeed" if runs_deepspeed(config) else "torch"
