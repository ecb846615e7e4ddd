"""The traced estimator: a real training step of the real transformers model, on fake tensors.

The model is built from its config under ``FakeTensorMode`` (no memory allocated, no data
computed), then the trial job's own loop runs on it: warm-up steps of forward, backward and
optimizer step per micro-batch, with the trial's checkpointing, precision, attention and
optimizer. A ``TorchDispatchMode`` counts the bytes of every live storage from the op that made
it until it is freed (like ``trials.memory``'s CPU tracker, which skips fake tensors), tags each
storage with the phase that made it, and snapshots the per-tag totals at the peak, which gives
the breakdown. llama-7b at seq 2048 takes about 10 s on 2 cores.

What a single fake process cannot run is taken from ``autotune.estimator.states``: ZeRO
sharding and offload of the model states across ``nproc`` GPUs (the trace then runs the model
in 16-bit, as DeepSpeed's engine does, and supplies activations, logits and temporaries), and
int8/nf4 base weights with LoRA (bitsandbytes is CUDA-only).
"""

from __future__ import annotations

import hashlib
import json
import os
import types
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autotune.estimator.base import PARTS, Estimate, Estimator
from autotune.estimator.formulas import FORMULAS
from autotune.estimator.speed import roofline
from autotune.estimator.states import deepspeed_states, estimator_states, host_with_activations
from autotune.estimator.workload import Workload
from autotune.models import stats_of
from trials.data import Shape, micro_shapes
from trials.memory import host_scope
from trials.techniques import OPTIMIZERS, PRECISIONS, TECHNIQUES
from trials.techniques.adapter import adapted_16bit
from trials.techniques.attention import attn_implementation
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.optimizer import (
    STOCHASTIC_ADAMW,
    TORCHAO_BLOCK,
    optimizer_of,
    step_choice,
    torchao_quantizes,
)
from trials.techniques.optimizer_in_backward import InBackward, steps_in_backward
from trials.techniques.packing import packs
from trials.techniques.precision import precision_of
from trials.techniques.terms import TRACED_STATES, TraceStep

#: the tag of storages made in host memory (offloaded activations): not on the traced device
HOST = "host"

CACHE_VERSION = 11
#: kernels that can't be built here, traced as one that keeps the same tensors for backward
#: (flash-attn and sdpa's flash kernel both keep q, k, v, the output and the log-sum-exp)
TRACED_ATTENTION = {"flash_attention_2": "sdpa"}
ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout")


def cache_dir() -> Path:
    root = os.environ.get("AUTOTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "autotune"
    )
    return Path(root)


class PhaseTracker(TorchDispatchMode):
    """Live storage bytes per phase tag; the per-tag totals at the peak are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "parameters"
        self.live: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self._tag: dict[int, tuple[str, int]] = {}
        self._host_births = False  # inside host_allocations(): new storages are host memory
        self.host_live = 0
        self.host_peak = 0
        # from a backward pass's first gradient hook to its end (ZeRO 1-2 make their gradient
        # bucket at that hook): the peak then, and the per-tag totals at it
        self.hooked = False
        self.hook_peak = 0
        self.at_hook_peak: dict[str, int] = {}
        # the instant a first gradient hook fires (the largest over backward passes): what
        # the gradient firing it is held with
        self.first_hook_peak = 0
        self.at_first_hook: dict[str, int] = {}
        # from the first gradient hook to the end of backward, the moment with the most bytes
        # besides the model states (an engine that shards or offloads them holds its own): the
        # total then, and the per-tag totals at it
        self.stateless_peak = 0
        self.stateless_total = 0
        self.at_stateless_peak: dict[str, int] = {}
        # inside backward before its first gradient hook (the logits' gradients, every
        # activation): the largest such moment and the per-tag totals at it
        self.backward_peak = 0
        self.at_backward_peak: dict[str, int] = {}

    def gradient_hook(self) -> None:
        """A gradient is complete; the first of a backward pass starts its hooked span."""
        if not self.hooked:
            self.hooked = True
            self._note_hook_peak()
            if self.total > self.first_hook_peak:
                self.first_hook_peak = self.total
                self.at_first_hook = dict(self.live)

    def end_backward(self) -> None:
        """The backward pass is over: its hooked span ends."""
        self.hooked = False

    def _note_hook_peak(self) -> None:
        if self.total > self.hook_peak:
            self.hook_peak = self.total
            self.at_hook_peak = dict(self.live)
        stateless = self.total - sum(self.live.get(k, 0) for k in TRACED_STATES)
        if stateless > self.stateless_peak:
            self.stateless_peak, self.stateless_total = stateless, self.total
            self.at_stateless_peak = dict(self.live)

    @contextmanager
    def host_allocations(self) -> Iterator[None]:
        """New storages are host memory (offloaded activations), not on the traced device."""
        previous, self._host_births = self._host_births, True
        try:
            yield
        finally:
            self._host_births = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self.track(t, self.phase)
        return out

    def track(self, t: torch.Tensor, tag: str) -> None:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        key = id(storage)
        if key in self._tag:
            return
        nbytes = storage.nbytes()
        if self._host_births:
            self._tag[key] = (HOST, nbytes)
            self.host_live += nbytes
            self.host_peak = max(self.host_peak, self.host_live)
            weakref.finalize(storage, self._release, key)
            return
        self._tag[key] = (tag, nbytes)
        self.live[tag] = self.live.get(tag, 0) + nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = dict(self.live)
        if self.hooked:
            self._note_hook_peak()
        elif self.phase == "temporaries" and self.total > self.backward_peak:
            self.backward_peak = self.total
            self.at_backward_peak = dict(self.live)
        weakref.finalize(storage, self._release, key)

    def retag(self, t: torch.Tensor, tag: str) -> None:
        key = id(t.untyped_storage())
        old = self._tag.get(key)
        if old is None or old[0] == tag:
            return
        self.live[old[0]] -= old[1]
        self.live[tag] = self.live.get(tag, 0) + old[1]
        self._tag[key] = (tag, old[1])

    def _release(self, key: int) -> None:
        tag, nbytes = self._tag.pop(key)
        if tag == HOST:
            self.host_live -= nbytes
            return
        self.live[tag] -= nbytes
        self.total -= nbytes


# --- optimizers that cannot step on fake tensors -----------------------------------------------


def _adafactor_states(optimizer: torch.optim.Optimizer, cuda: bool) -> None:
    """torch's Adafactor calls ``.item()`` in its update; allocate its states as it does."""
    for group in optimizer.param_groups:
        optimizer._init_group(group, [], [], [], [], [], [])  # type: ignore[attr-defined]


def _adamw_8bit_states(optimizer: torch.optim.Optimizer, cuda: bool) -> None:
    """bitsandbytes AdamW8bit: two uint8 states plus one fp32 absmax per 256-value block for
    tensors of at least 4096 values, fp32 states below that (its ``min_8bit_size``)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            if p.numel() >= 4096:
                blocks = (p.numel() + 255) // 256
                state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                state["absmax1"] = torch.zeros(blocks)
                state["absmax2"] = torch.zeros(blocks)
            else:
                state["state1"] = torch.zeros_like(p)
                state["state2"] = torch.zeros_like(p)


def _low_bit_states(bits: int) -> Any:
    """torchao's AdamW8bit/4bit: per moment, uint8 codes (``bits`` per value), an fp32 scale
    per block and a code book where ``torchao_quantizes``, fp32 moments elsewhere; and,
    parameter by parameter, the temporaries its step makes (eager on the CPU backend,
    compiled on CUDA: ``OptimizerChoice.step_temporaries``)."""
    block = TORCHAO_BLOCK[bits]
    choice = OPTIMIZERS[f"adamw_torchao_{bits}bit"]

    def allocate(optimizer: torch.optim.Optimizer, cuda: bool) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                pure = p.dtype == torch.bfloat16  # pure bf16's weights
                temporaries = torch.empty(choice.step_temporaries(p.numel(), cuda, pure) // 4)
                del temporaries
                state = optimizer.state[p]
                if state:
                    continue
                n = p.numel()
                for moment in ("exp_avg", "exp_avg_sq"):
                    if torchao_quantizes(n, bits):
                        state[moment + "_codes"] = torch.zeros(n * bits // 8, dtype=torch.uint8)
                        state[moment + "_scale"] = torch.zeros(n // block)
                        state[moment + "_qmap"] = torch.zeros(2**bits)  # its code book
                    else:
                        state[moment] = torch.zeros_like(p)

    return allocate


def _stochastic_adamw_states(optimizer: torch.optim.Optimizer, cuda: bool) -> None:
    """torchao's AdamW with bf16 stochastic rounding (a compiled step fake tensors can't run):
    two moments like each bf16 parameter and, parameter by parameter, its step's temporaries."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            temporaries = torch.empty(STOCHASTIC_ADAMW.step_temporaries(p.numel(), cuda, True) // 4)
            del temporaries
            state = optimizer.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)


#: optimizer -> (stand-in to construct, how its step runs on fake tensors)
FAKE_STEP: dict[str, tuple[str, Any]] = {
    "stochastic_adamw": ("adamw", _stochastic_adamw_states),
    "adafactor": ("adafactor", _adafactor_states),
    "adamw_8bit": ("adamw", _adamw_8bit_states),
    "paged_adamw_8bit": ("adamw", _adamw_8bit_states),
    "adamw_torchao_8bit": ("adamw", _low_bit_states(8)),
    "adamw_torchao_4bit": ("adamw", _low_bit_states(4)),
}


def _step_optimizer(name: str, optimizer: torch.optim.Optimizer, cuda: bool) -> None:
    fake = FAKE_STEP.get(name)
    if fake is None:
        optimizer.step()
    else:
        fake[1](optimizer, cuda)


# --- what fake tensors can't run as written --------------------------------------------------


@contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _balanced_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' expert loop with the routing fixed to a balanced one: each expert gets
    ``tokens * top_k / experts`` tokens. The real loop asks which experts were hit
    (``nonzero``), a data-dependent shape fake tensors cannot know; the tensors each expert
    keeps for backward are the same as with balanced routing."""
    n_experts = int(self.num_experts)  # type: ignore[arg-type]
    tokens, top_k = top_k_index.shape
    per_expert = max(1, tokens * top_k // n_experts)
    out = torch.zeros_like(hidden_states)
    for e in range(n_experts):
        idx = torch.arange(e * per_expert, (e + 1) * per_expert, device=hidden_states.device)
        idx = idx % tokens
        state = hidden_states[idx]
        gate, up = torch.nn.functional.linear(state, self.gate_up_proj[e]).chunk(2, dim=-1)  # type: ignore[index]
        h = self.act_fn(gate) * up  # type: ignore[operator]
        h = torch.nn.functional.linear(h, self.down_proj[e])  # type: ignore[index]
        h = h * top_k_weights[idx, e % top_k, None]
        out.index_add_(0, idx, h.to(out.dtype))
    return out


def balance_experts(model: torch.nn.Module, model_config: dict[str, Any]) -> int:
    """Swap every fused-experts module's forward for the balanced one; returns how many."""
    swapped = 0
    for module in model.modules():
        if all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "num_experts", "act_fn")):
            module.forward = types.MethodType(_balanced_experts_forward, module)
            swapped += 1
    return swapped


# --- the traced step ---------------------------------------------------------------------------


def trace_step(
    workload: Workload,
    config: dict[str, Any],
    steps: int = 2,
    shape: Shape | None = None,
    packed: bool = False,
) -> dict[str, int]:
    """Peak bytes and their breakdown of ``steps`` training steps of the trial job's loop, one
    process of the workload; without its ``gpu``: as the CPU trial backend runs it (sdpa with
    attention dropout); ``shape``: variable-length data's largest micro-batch (``packed``: rows
    of several documents, each with its own positions)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trials.job import build_model

    model_config, seq_len = workload.model_config, workload.seq_len_tokens
    global_batch_size, cuda = workload.global_batch_sequences, workload.gpu is not None
    micro, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    # Micro-batches after the second repeat the second one's memory exactly (gradients already
    # allocated, same activations), so two stand for any accumulation count.
    accum = min(2, accum)
    precision = PRECISIONS[precision_of(config)]
    deepspeed = deepspeed_states(config)
    # the model built in 16 bits, no autocast (each technique's ``model_in_16_bits``: pure
    # bf16, FSDP2; DeepSpeed and adapters over a 16-bit base by the trace's own flags)
    model16 = deepspeed or TECHNIQUES.model_in_16_bits(config) or bool(config.get("model16"))
    opt_name = optimizer_of(config)
    if step_choice(config) is STOCHASTIC_ADAMW and not deepspeed:
        opt_name = "stochastic_adamw"
    vocab = int(model_config["vocab_size"])
    tracker = PhaseTracker()
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        tracker,
        host_scope(tracker.host_allocations),
    ):
        attention = attn_implementation(config)
        # DeepSpeed's engine runs the model in 16 bits: build it so (``model.to(dtype)`` can't
        # swap parameters under fake tensors)
        dtype = precision.autocast_dtype if model16 else None
        traced_cfg = dict(model_config)
        if attention != "eager" and cuda:
            # CUDA's fused kernels apply attention dropout inside (no mask kept); the CPU's
            # sdpa falls back to its math path and keeps the s x s probabilities
            traced_cfg.update({key: 0.0 for key in ATTENTION_DROPOUT_KEYS})
        fallback = 0
        with _default_dtype(dtype):
            try:
                model = build_model(
                    traced_cfg,
                    TRACED_ATTENTION.get(attention, attention),
                    0,
                    dtype=dtype or torch.float32,
                )
            except ValueError as exc:  # e.g. Gemma2 refuses sdpa in transformers 5
                if "attention implementation" not in str(exc):
                    raise
                model = build_model(traced_cfg, "eager", 0, dtype=dtype or torch.float32)
                fallback = 1
        balance_experts(model, model_config)
        model.train()
        model = TECHNIQUES.apply_traced(model, config, torch.device("cpu"))

        def grad_ready(p: torch.Tensor) -> None:
            if p.grad is not None:
                tracker.retag(p.grad, "gradients")
            tracker.gradient_hook()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(grad_ready)
        head = model.get_output_embeddings()  # type: ignore[operator]
        if isinstance(head, torch.nn.Module):

            def to_logits(*_: Any) -> None:
                if tracker.phase == "activations":
                    tracker.phase = "logits/loss"

            head.register_forward_pre_hook(to_logits)
        factory = OPTIMIZERS[FAKE_STEP.get(opt_name, (opt_name,))[0]].factory
        optimizer: torch.optim.Optimizer | None = None
        if steps_in_backward(config) and not deepspeed:

            def step_in_backward(one: torch.optim.Optimizer) -> None:
                tracker.phase = "optimizer_states"  # its states are made in the first step
                _step_optimizer(opt_name, one, cuda)
                tracker.phase = "temporaries"

            InBackward(model.parameters(), lambda ps: factory(ps, 1e-3), step=step_in_backward)
        else:
            optimizer = factory(model.parameters(), 1e-3)
        autocast = (
            torch.autocast("cpu", dtype=precision.autocast_dtype)
            if precision.autocast_dtype is not None and not model16
            else nullcontext()
        )
        for _ in range(steps):
            for _ in range(accum):
                tracker.phase = "activations"
                rows, length = (shape.rows, shape.length) if shape else (micro, seq_len)
                ids = torch.randint(0, vocab, (rows, length))
                inputs = {"input_ids": ids, "labels": ids}
                if packed:  # two documents a row: transformers builds the block-causal mask
                    half = torch.arange(length) % max(1, length // 2)
                    inputs["position_ids"] = half.expand(rows, length)
                with autocast:
                    loss = model(**inputs).loss / accum
                tracker.phase = "temporaries"
                loss.backward()
                tracker.end_backward()
                del loss, ids
            if optimizer is not None:  # else stepped in backward, parameter by parameter
                tracker.phase = "optimizer_states"
                _step_optimizer(opt_name, optimizer, cuda)
                optimizer.zero_grad(set_to_none=True)
        del model, optimizer
    parts = {k: max(0, tracker.at_peak.get(k, 0)) for k in PARTS}
    parts["peak"] = tracker.peak
    parts.update({f"hook:{k}": max(0, tracker.at_hook_peak.get(k, 0)) for k in PARTS})
    parts["hook:peak"] = tracker.hook_peak
    parts.update({f"first_hook:{k}": max(0, tracker.at_first_hook.get(k, 0)) for k in PARTS})
    parts["first_hook:peak"] = tracker.first_hook_peak
    parts.update({f"bwd:{k}": max(0, tracker.at_backward_peak.get(k, 0)) for k in PARTS})
    parts["bwd:peak"] = tracker.backward_peak
    parts.update({f"stateless:{k}": max(0, tracker.at_stateless_peak.get(k, 0)) for k in PARTS})
    parts["stateless:peak"] = tracker.stateless_total
    parts["host_activations"] = tracker.host_peak
    parts["eager_fallback"] = fallback
    return parts


def _cache_key(workload: Workload, config: dict[str, Any]) -> str:
    seq, gbs = workload.seq_len_tokens, workload.global_batch_sequences
    blob = json.dumps(
        [CACHE_VERSION, torch.__version__, workload.model_config, config, seq, gbs], sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class TracedEstimator(Estimator):
    """Peak memory from a fake-tensor trace of the trial job's step; cached per (model, config)."""

    name = "traced"

    def __init__(self, cache: Path | None = None, use_cache: bool = True) -> None:
        self.cache = (cache or cache_dir()) / "traced"
        self.use_cache = use_cache

    def traced_parts(self, workload: Workload, config: dict[str, Any]) -> dict[str, int]:
        """The fake step's figures (``trace_step``) of one process of ``workload``, cached."""
        # Only what the single fake process runs matters for the trace: ZeRO and offload are
        # applied afterwards, and a quantized model traces as its 16-bit LoRA-free self.
        untraced = TECHNIQUES.untraced()
        traced_cfg = {k: v for k, v in config.items() if k not in untraced}
        if adapted_16bit(config):
            # adapters over a 16-bit base trace as the 16-bit model (peft's modules can't be
            # moved between dtypes on fake tensors); their own activations are added after
            traced_cfg["model16"] = True
        if deepspeed_states(config):
            traced_cfg["deepspeed"] = True
        # the CPU's kernels trace what a GPU's fuse (attention dropout): its own cache entry
        keyed = traced_cfg if workload.gpu is not None else {**traced_cfg, "cpu_kernels": True}
        documents = workload.documents
        # one process's rows: the fake step is one rank's (the workload's ``processes`` apart)
        shape = (
            micro_shapes(
                config, workload.seq_len_tokens, workload.global_batch_sequences, documents
            )[0]
            if documents
            else None
        )
        packed = shape is not None and packs(config)
        if shape is not None:
            keyed = {**keyed, "shape": [shape.rows, shape.length, packed]}
        key = _cache_key(workload, keyed)
        path = self.cache / f"{key}.json"
        if self.use_cache and path.is_file():
            try:
                return {k: int(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError):
                pass
        parts = trace_step(
            workload, {**traced_cfg, **_ds_flags(config)}, shape=shape, packed=packed
        )
        if self.use_cache:
            self.cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(parts))
            tmp.replace(path)
        return parts

    def estimate(self, workload: Workload, config: dict[str, Any]) -> Estimate:
        model_config, nproc, gpu = workload.model_config, workload.processes, workload.device
        global_batch_size = workload.global_batch_sequences
        parts = self.traced_parts(workload, config)
        notes: list[str] = []
        st = stats_of(model_config)
        if st.experts:
            notes.append(
                f"MoE routing traced as balanced ({st.top_k} of {st.experts} experts per token, "
                "each expert given tokens x top_k / experts): fake tensors cannot route"
            )
        if parts.get("eager_fallback"):
            notes.append(
                f"transformers cannot build this model with {attn_implementation(config)}: "
                "traced with eager attention (s x s scores kept)"
            )
        elif attn_implementation(config) in TRACED_ATTENTION:
            notes.append(
                f"{attn_implementation(config)} (CUDA only) traced as "
                f"{TRACED_ATTENTION[attn_implementation(config)]}, which keeps the same tensors"
            )
        _, accum = micro_and_accumulation(config, global_batch_size, strict=False)
        states = estimator_states(workload, config)
        largest = micro_shapes(
            config, workload.seq_len_tokens, global_batch_size, workload.documents, nproc
        )[0]

        def analytical_peak(cfg: Mapping[str, Any]) -> int:
            from autotune.estimator.analytical import AnalyticalEstimator

            return AnalyticalEstimator().estimate(workload, dict(cfg)).peak_bytes

        step = TraceStep(
            config=config,
            stats=st,
            formulas=FORMULAS,
            states=states,
            workload=workload,
            accum=accum,
            tokens=largest.rows * largest.length,
            parts=parts,
            roles=PARTS,
            peak=parts["peak"],
            breakdown={k: parts.get(k, 0) for k in PARTS},
            notes=notes,
            analytical_peak=analytical_peak,
        )
        # the states the one fake process could not hold, then what it kept that the real
        # step does not (each technique's ``traced_states``, ``traced_activations``)
        TECHNIQUES.traced_terms(step)
        peak, breakdown = step.peak, step.breakdown
        offloaded = parts.get("host_activations", 0)
        host = host_with_activations(states.host, offloaded, workload, notes)
        est = Estimate(int(peak), breakdown, method=self.name, notes=notes, host_breakdown=host)
        if gpu is not None:
            roofline(est, workload, config, offloaded)
        return est


def _ds_flags(config: dict[str, Any]) -> dict[str, Any]:
    return {"deepspeed": True} if deepspeed_states(config) else {}
