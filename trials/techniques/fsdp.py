"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer states
sharded over the ranks, as an engine beside DeepSpeed.

Each decoder block and then the root module are sharded (``fully_shard``, block by block, the
way torchtune and accelerate wrap transformer layers); a block's parameters are all-gathered
for its forward and backward. ``full_shard`` frees them again after forward
(``reshard_after_forward=True``: ZeRO-3's memory, one more all-gather in backward);
``shard_grad_op`` keeps them gathered until backward (ZeRO-2's). Under bf16 the policy is
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the blocks compute on bf16
copies of the fp32 shards, which stay the master weights (the mixed class, as autocast).
``fsdp_offload: cpu`` is ``CPUOffloadPolicy``: the shards, their gradients and the optimizer's
states live in host memory and the step runs there. Exact in fp32 (the same sums, reduced in
another order).

What it excludes, in the space: fp16 (its loss scaler would need FSDP's sharded scaler),
DeepSpeed (``zero_stage`` exists only with ``fsdp: off``), the optimizer step in backward, and
quantized base weights (bitsandbytes' parameters are not DTensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Forbid, Knob, Run, Technique, When
from trials.techniques.cross_entropy import is_chunked

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.techniques.terms import MemoryStep, TraceStep

#: fsdp choice -> reshard_after_forward
RESHARD = {"full_shard": True, "shard_grad_op": False}


def fsdp_mode(config: Config) -> str:
    return str(config.get("fsdp", "off"))


def runs_fsdp(config: Config) -> bool:
    return fsdp_mode(config) in RESHARD


def offloads_shards(config: Config) -> bool:
    return runs_fsdp(config) and config.get("fsdp_offload") == "cpu"


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (its decoder layers): the children of every ``ModuleList``
    whose children are all of one class (``model.layers`` in LLaMA, ``transformer.h`` in
    GPT-2, whatever the architecture names it)."""
    from torch import nn

    found: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(child) for child in module}
            if len(kinds) == 1:
                found.extend(module)
    return found


def shard(model: nn.Module, config: Config, device: torch.device, world: int) -> nn.Module:
    """``fully_shard`` on each block, then on the root, over ``world`` ranks of ``device``'s
    kind (the process group must exist)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from trials.techniques.precision import PRECISIONS, pure_bf16

    mesh = init_device_mesh(device.type, (world,))
    half = PRECISIONS[str(config.get("precision", "fp32"))].autocast_dtype
    # pure bf16: the shards are bf16 themselves (built so), gathered and reduced in bf16
    policy = (
        MixedPrecisionPolicy()
        if pure_bf16(config)
        else MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    )
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": RESHARD[fsdp_mode(config)],
        "mp_policy": policy,
    }
    if offloads_shards(config):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class Fsdp(Technique):
    family = "fsdp"
    knobs = (
        Knob(
            "fsdp",
            ("off", "full_shard", "shard_grad_op"),
            baseline="off",
            from_bool=("full_shard", "off"),
            short=lambda v: "" if v == "off" else f"fsdp2-{v}",
        ),
        Knob(
            "fsdp_offload",
            ("none", "cpu"),
            baseline="none",
            memory_order=lambda v: {"cpu": 0.0, "none": 1.0}[v],  # offloaded, less on the device
            short=lambda v: "" if v == "none" else "fsdp2-cpu-offload",
        ),
    )
    whens = (
        When("fsdp_offload", {"fsdp": tuple(RESHARD)}, "FSDP2 offloads its shards"),
        When("zero_stage", {"fsdp": "off"}, "FSDP2 and DeepSpeed are two engines: one at a time"),
    )
    forbids = (
        Forbid(
            {"precision": "fp16", "fsdp": tuple(RESHARD)},
            "fsdp runs without fp16 (its loss scaler would need FSDP's sharded scaler)",
            job=True,
        ),
        Forbid(
            {"optimizer_in_backward": True, "fsdp": tuple(RESHARD)},
            "fsdp runs without the optimizer step in backward",
            job=True,
        ),
        Forbid(
            {
                "optimizer": (
                    "adafactor",
                    "adamw_8bit",
                    "paged_adamw_8bit",
                    "adamw_torchao_8bit",
                    "adamw_torchao_4bit",
                ),
                "fsdp": tuple(RESHARD),
            },
            "FSDP2 steps DTensor shards: torch's Adafactor can't (an in-place pow on a partial "
            "placement), and bitsandbytes' and torchao's low-bit states are not DTensors",
        ),
        Forbid(
            {"quantization": ("int8", "nf4"), "fsdp": tuple(RESHARD)},
            "bitsandbytes' quantized parameters are not DTensors",
        ),
    )

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        if not runs_fsdp(config):
            return {}
        # transformers' Trainer hands these to accelerate's FullyShardedDataParallelPlugin
        # (version 2: fully_shard; the blocks found from the model's _no_split_modules)
        return {
            "fsdp": True,
            "fsdp_config": {
                "version": 2,
                "reshard_after_forward": RESHARD[fsdp_mode(config)],
                "cpu_offload": offloads_shards(config),
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "state_dict_type": "SHARDED_STATE_DICT",
            },
        }

    def accelerate(self, config: Config, run: Run) -> dict[str, Any]:
        if not runs_fsdp(config):
            return {}
        return {
            "distributed_type": "FSDP",
            "fsdp_config": {
                "fsdp_version": 2,
                "fsdp_reshard_after_forward": RESHARD[fsdp_mode(config)],
                "fsdp_offload_params": offloads_shards(config),
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                "fsdp_cpu_ram_efficient_loading": True,
            },
        }

    def model_in_16_bits(self, config: Config) -> bool:
        # FSDP2 computes on 16-bit copies of its shards (its mixed-precision policy)
        return runs_fsdp(config)

    def priced_as(self, config: Config) -> Config:
        # FSDP2's traffic priced as the ZeRO stage that moves the same bytes: full_shard
        # gathers each block in forward and again in backward and reduce-scatters its gradients
        # (stage 3's volume, 1.5x DDP's all-reduce); shard_grad_op gathers once per step (stage
        # 2's); ``fsdp_offload`` keeps the shards on the host and steps there (ZeRO-Offload's
        # PCIe copies and host step, at the same bytes though torch's AdamW runs there, not
        # DeepSpeed's AVX Adam)
        if not runs_fsdp(config):
            return config
        out = {**config, "zero_stage": 3 if RESHARD[fsdp_mode(config)] else 2}
        if offloads_shards(config):
            out.update(offload_optimizer="cpu", offload_param="cpu")
        return out

    def memory(self, step: MemoryStep) -> None:
        # chunked cross-entropy's head-sized gradient buffers (autograd summing the slices'
        # gradients of autocast's 16-bit head copy before ``.grad``) do not exist under FSDP2's
        # bf16 policy: the slices' gradients accumulate in the gathered 16-bit head itself,
        # which is ``fsdp_held``'s head gradient (measured on scale replicas of llama-7b:
        # tests/test_fsdp_replica.py; in fp32 the measured ranks keep them)
        if runs_fsdp(step.config) and step.half and step.logit_tokens < step.tokens:
            step.bwd_logits_extra -= 2 * 2 * step.head_params

    def moments(self, step: MemoryStep) -> None:
        # the first block's backward (the last recomputed) apart from the root's gradients
        # reduced at the very end, when no activation is left; a rank's shards and what it
        # gathers in each phase (``fsdp_held``). Besides the checkpointed layers' inputs, the
        # outputs their selective checkpointing saves (``checkpoint_save``) stay until each
        # layer's backward (the layer in backward's own are among its recomputed activations)
        if not runs_fsdp(step.config):
            return
        saved = step.saved_kept - step.saved_kept // max(1, step.n_ckpt)
        step.moments["first layer's backward"] = (0, step.bwd_layers + saved, 0, 0)
        step.moments["end of backward"] = (0, 0, 0, 0)

        def held(moment: str) -> dict[str, int]:
            return step.formulas.fsdp_held(
                step.stats, step.config, step.nproc, moment, step.accum, step.cuda
            )

        step.held = held

    def traced_states(self, step: TraceStep) -> None:
        # the trace ran one unsharded process. Its activations and logits at the first
        # gradient hook (the start of backward), or in backward before it (the logits'
        # gradients; under chunked cross-entropy one slice's, the trace's own sum of the
        # slices' head gradients standing for the gathered head's), beside what a rank holds
        # then (``fsdp_held``: shards, gathered parameters, the head's gradient), unless a
        # moment with no activation left (the end of backward's reductions, the step) holds
        # more
        if not runs_fsdp(step.config) or step.taken:
            return
        step.taken = True

        def held(moment: str) -> dict[str, int]:
            return step.formulas.fsdp_held(
                step.stats, step.config, step.nproc, moment, step.accum, step.cuda
            )

        start = held("start of backward")
        width = 2 if str(step.config.get("precision", "fp32")) in ("bf16", "fp16") else 4
        head = width * step.stats.vocab * step.stats.hidden if is_chunked(step.config) else 0
        peak, breakdown = -1, {}
        for prefix in ("bwd:", "first_hook:"):
            net, parts = step.net(prefix)
            rank = {**start, "gradients": start["gradients"] - head * (prefix == "bwd:")}
            if net + sum(rank.values()) > peak:
                peak = net + sum(rank.values())
                breakdown = {
                    **parts,
                    **rank,
                    "temporaries": parts["temporaries"] + rank["temporaries"],
                }
        # later in backward: the layers recomputed one by one beside every checkpointed
        # layer's input and saved outputs (the trace's most bytes besides its model states
        # after that hook), with the shards and gathered parameters a rank holds at the first
        # layer's backward; its reduce-scatter's copies come once that layer's backward is
        # over, its recomputed activations gone (measured on scale replicas of llama-7b:
        # tests/test_fsdp_replica.py)
        later_peak, later = step.net("stateless:")
        first = {**held("first layer's backward"), "temporaries": 0}
        if later_peak + sum(first.values()) > peak:
            peak = later_peak + sum(first.values())
            breakdown = {**later, **first, "temporaries": later["temporaries"]}
        for moment in ("end of backward", "optimizer step"):
            alone = held(moment)
            if sum(alone.values()) > peak:
                peak, breakdown = sum(alone.values()), {**dict.fromkeys(step.roles, 0), **alone}
        step.peak, step.breakdown = peak, {k: breakdown.get(k, 0) for k in step.roles}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "fsdp": fsdp_mode(config) if runs_fsdp(config) else None,
            "fsdp_offload": offloads_shards(config),
        }


TECHNIQUE = Fsdp()
