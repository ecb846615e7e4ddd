"""The analytical estimator: closed-form bytes, instant, for any config.

Activations follow Korthikanti et al. 2022 (bytes per token per layer, s x s scores only for
eager attention) but counted for the LLaMA decoder as transformers runs it, tensor by tensor
(tokens T = s*b, hidden h, MLP width I, attention width q = a*d, key/value width k*d):

* residual stream and RMSNorm run in fp32 under autocast (transformers upcasts the norm), so
  each norm keeps its fp32 input, normalised and scaled outputs; the linears keep 16-bit copies
  of their inputs; q, k, v after RoPE, the attention output and its contiguous copy; the MLP
  keeps gate, up, SiLU(gate) and their product. Per token per layer:
  fp32: 4*(6h + 2q + 2kd + q + 4I) = 4*(6h + 3q + 2kd + 4I); 16-bit: 24h + 4h + 2*(3q + 2kd) + 8I.
* eager attention adds the softmax output per layer: b*a*s^2 x 4 bytes (fp32) or 6 (fp32
  softmax + its 16-bit copy), i.e. Korthikanti's 5as/h term; sdpa/flash keep none of it.
* autocast keeps a 16-bit copy of every linear weight for backward (2 bytes per linear param).
* full checkpointing keeps each layer's input (4h per token) plus one layer recomputed at a
  time in backward; selective every k-th layer keeps the others whole; ``checkpoint_save``
  keeps the attention output (and per-head log-sum-exp) or every projection's output besides.
* logits and loss: fp32 log-softmax kept from forward; at the start of backward its gradient and
  the logits' gradient: 12 T*v bytes (+2 T*v of 16-bit logits in forward under autocast); with
  chunked cross-entropy T is one slice's tokens (the others' logits never exist at the time).

The peak is the largest of these moments: end of forward, start of backward (logits gradients),
end of backward (all gradients and the last recomputed layer), optimizer step; under ZeRO also
the first gradient hook (the kept activations and the gradient bucket ZeRO 1-2 make then). With the
optimizer step in backward no moment holds all gradients: the output layer's step (its gradient
and step temporaries over every kept activation) and the end of backward replace the step.
"""

from __future__ import annotations

from typing import Any

from autotune.estimator.activations import (
    NORM_BYTES,
    adapter_activation_bytes,
    dropout_mask_bytes,
    layer_activation_bytes,
    saved_op_bytes,
)
from autotune.estimator.base import PARTS, Estimate, Estimator
from autotune.estimator.gpus import GpuSpec
from autotune.estimator.speed import roofline
from autotune.estimator.states import (
    adapter_shapes,
    deepspeed_states,
    estimator_states,
    fsdp_held,
    host_with_activations,
    numel,
    pure_outside_deepspeed,
    qlora_shapes,
    zero_states_at,
)
from autotune.models import stats_of
from trials.data import Documents, micro_shapes
from trials.techniques.activation_offload import offloads_activations
from trials.techniques.adapter import adapted_16bit, adapts
from trials.techniques.cross_entropy import loss_tokens
from trials.techniques.fsdp import runs_fsdp
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.optimizer import step_choice
from trials.techniques.optimizer_in_backward import steps_in_backward
from trials.techniques.packing import packs


class AnalyticalEstimator(Estimator):
    name = "analytical"

    def estimate(
        self,
        model_config: dict[str, Any],
        config: dict[str, Any],
        *,
        seq_len: int,
        global_batch_size: int,
        nproc: int = 1,
        gpu: GpuSpec | None = None,
        documents: Documents | None = None,
    ) -> Estimate:
        st = stats_of(model_config)
        h, layers, vocab = st.hidden, st.layers, st.vocab
        _, accum = micro_and_accumulation(config, global_batch_size, strict=False)
        # the largest micro-batch's rows (fixed-length data: micro-batch x sequence length)
        big = micro_shapes(config, seq_len, global_batch_size, documents, nproc)[0]
        micro, length = big.rows, big.length
        tokens = micro * length
        half = config.get("precision", "fp32") in ("bf16", "fp16")
        deepspeed = deepspeed_states(config)
        fsdp = runs_fsdp(config)
        # the model itself in 16 bits (DeepSpeed's engine; FSDP2's mixed-precision policy; pure
        # bf16, built in bf16): no autocast copies of the weights, a 16-bit residual stream and
        # logits
        pure = pure_outside_deepspeed(config)
        adapted = adapts(config)  # LoRA/DoRA: the base frozen (16-bit under bf16/fp16)
        model16 = deepspeed or fsdp or pure or adapted_16bit(config)
        states = estimator_states(model_config, config, nproc, global_batch_size, gpu)
        params = states.parts["parameters"]
        grads = states.parts["gradients"]
        optim = states.parts["optimizer_states"]

        layer_linear = st.layer_matrix_params + st.expert_params
        linear_params = layer_linear * layers
        head_params = vocab * h
        quantized = str(config.get("quantization", "none") or "none") != "none"
        # frozen quantized weights are dequantized per use, not kept as 16-bit copies
        cached_params = head_params + (0 if quantized else linear_params)
        weight_cache = 2 * cached_params if half and not model16 else 0
        layer_weight_cache = 2 * layer_linear if half and not quantized and not adapted else 0

        cuda = gpu is not None
        per_layer = layer_activation_bytes(st, config, length, micro, cuda)
        if adapted:
            per_layer += adapter_activation_bytes(st, config, tokens) // layers
        stream_width = 2 if model16 and half else 4  # the residual stream's dtype
        stream = stream_width * h * tokens  # a layer's input
        ckpt = str(config.get("gradient_checkpointing", "off"))
        every = {"off": 0, "full": 1}.get(ckpt, int(config.get("checkpoint_every", 2)))
        n_ckpt = layers // every if every else 0
        # a checkpointed layer keeps its input and, selective per op, the saved ops' outputs
        kept = n_ckpt * (stream + saved_op_bytes(st, config, length, micro))
        kept += (layers - n_ckpt) * per_layer
        recompute = (per_layer + layer_weight_cache) if every else 0
        # the final norm (what the norm's kind keeps) and the head's input (its output, or under
        # autocast its 16-bit copy); the embedding's output is the first layer's input
        mode = "pure16" if model16 and half else "autocast" if half else "fp32"
        final_norm = NORM_BYTES[st.norm][mode] * h * tokens
        head_acts = final_norm + (2 if half else 4) * h * tokens
        if st.embd_dropout > 0:  # its mask (the output is the first layer's input)
            head_acts += dropout_mask_bytes(stream_width, cuda) * h * tokens
        # under autocast 16-bit logits plus the fp32 log-softmax; DeepSpeed's 16-bit model keeps
        # its 16-bit logits and the loss's fp32 upcast
        # (chunked cross-entropy: one slice's logits at a time, recomputed in backward)
        logit_tokens = loss_tokens(config, tokens)
        fwd_logits = (6 if half and model16 else 10 if half else 8) * logit_tokens * vocab
        bwd_logits = 12 * logit_tokens * vocab
        if logit_tokens < tokens:
            # the head's weight is used once per slice: autograd sums its slices' gradients in
            # a buffer before it reaches ``.grad`` (the sum so far and the new slice's: two
            # head-sized gradients, of the 16-bit weight copy under autocast); and the hidden
            # states' gradient filled slice by slice
            grad_bytes = 2 if half else 4
            # a frozen head (adapters, a quantized base with LoRA): none
            head_grads = 0 if adapted or quantized else 2 * grad_bytes * head_params
            bwd_logits += head_grads + 4 * h * tokens
        if (
            documents is not None
            and packs(config)
            and str(config.get("attention")) != "flash_attention_2"
        ):
            # packed rows: transformers builds one block-causal boolean mask (rows x s x s),
            # which every layer's attention keeps for backward
            head_acts += micro * length * length
        acts = kept + head_acts
        cache_in_fwd = weight_cache
        cache_in_bwd = 0 if every == 1 else weight_cache * (layers - n_ckpt) // max(1, layers)
        bwd_layers = n_ckpt * stream + recompute
        host_acts = 0
        if offloads_activations(config):
            # what the layers save goes to the host, up to the output layer (with the final
            # norm's saved tensors; the head's input stays), and backward
            # brings one layer back at a time (with its recompute); per-op checkpointing's saved
            # ops stay in the checkpoint's own store, and autocast's cast cache still holds the
            # weight copies the layers save (their host copies are extra)
            saved_ops = n_ckpt * saved_op_bytes(st, config, length, micro)
            host_acts = kept - saved_ops + final_norm
            if half and not model16 and not quantized:
                host_acts += 2 * layer_linear * (layers - n_ckpt)
            acts = head_acts - final_norm + saved_ops
            bwd_layers = stream + recompute
        grads_before = grads if accum > 1 else 0
        largest = st.largest_param
        if adapted:  # the largest trainable tensor: an adapter's
            largest = max(numel(s) for s in adapter_shapes(st, config)[0])
        elif quantized:  # a quantized base's LoRA adapters (``states.qlora_shapes``)
            largest = max(numel(s) for s in qlora_shapes(st, config))
        step_temps = (
            step_choice(config).step_temporaries(largest, cuda, pure) if not deepspeed else 0
        )
        gbytes = 2 if pure else 4  # a gradient's bytes per value (the parameter's dtype)

        moments = {
            "end of forward": (grads_before, acts + cache_in_fwd, fwd_logits, 0),
            "start of backward": (grads_before, acts + cache_in_bwd, bwd_logits, 0),
            "end of backward": (grads, bwd_layers, 0, 0),
            "optimizer step": (grads, 0, 0, step_temps),
        }
        if states.phases is not None:
            # ZeRO 1-2 make the gradient bucket at the output layer's gradient hook, once the
            # logits' gradients are gone and every kept activation still is (under stage 3 the
            # moment holds what the start of backward does, less the logits)
            moments["first gradient hook"] = (grads_before, acts + cache_in_bwd, 0, 0)
            # and reduce at the accumulation boundary once backward is over (its own buffers);
            # ZeRO-2 under offload also where the gradients first overflow the bucket, with the
            # activations of the layers whose backward is still to come
            moments["accumulation boundary"] = (grads, 0, 0, 0)
            if states.phases.overflow:
                held_acts = int((acts + cache_in_bwd) * states.phases.overflow_held)
                moments["bucket overflow"] = (grads_before, held_acts, 0, 0)
        if steps_in_backward(config) and not deepspeed:
            # each parameter stepped as its gradient completes, and the gradient freed: no
            # moment holds every gradient. The output layer's (the largest) is stepped first,
            # once the logits' gradients are gone and every kept activation still is; in the
            # first layer's backward one MLP matrix's at most; the embedding's after the layers
            one_grad = min(grads, gbytes * largest)
            matrix = min(one_grad, gbytes * h * st.intermediate)
            del moments["optimizer step"], moments["end of backward"]
            # the head's 16-bit weight copy (autocast's, saved for its input's gradient) is
            # freed with the head's backward, before its step
            head_cache = 2 * head_params * (layers - n_ckpt) // layers if weight_cache else 0
            head_acts_cache = acts + max(0, cache_in_bwd - head_cache)
            moments["output layer's step"] = (one_grad, head_acts_cache, 0, step_temps)
            moments["first layer's backward"] = (matrix, bwd_layers, 0, 2 * matrix)
            moments["end of backward"] = (one_grad, 0, 0, step_temps)
        if fsdp:
            # the first block's backward (the last recomputed) apart from the root's gradients
            # reduced at the very end, when no activation is left (``fsdp_held``)
            moments["first layer's backward"] = (0, bwd_layers, 0, 0)
            moments["end of backward"] = (0, 0, 0, 0)
        peak, where, breakdown = -1, "", {k: 0 for k in PARTS}
        for name, (g, a, lg, tmp) in moments.items():
            held = {"parameters": params, "gradients": g, "optimizer_states": optim}
            held["temporaries"] = tmp
            if states.phases is not None:  # ZeRO: what DeepSpeed holds in this phase
                held = zero_states_at(states.phases, name, accum)
            elif fsdp:  # FSDP2: its shards and what it gathers in this phase
                held = fsdp_held(st, config, nproc, name, accum, cuda=gpu is not None)
            total = sum(held.values()) + a + lg
            if total > peak:
                peak, where = total, name
                breakdown = {**held, "activations": a, "logits/loss": lg}
        notes = [f"peak at {where}", *states.notes]
        host = host_with_activations(states.host, host_acts, nproc, gpu, notes)
        est = Estimate(int(peak), breakdown, method=self.name, notes=notes, host_breakdown=host)
        if gpu is not None:
            roofline(
                est,
                model_config,
                config,
                seq_len,
                global_batch_size,
                nproc,
                gpu,
                host_acts,
                documents=documents,
            )
        return est
