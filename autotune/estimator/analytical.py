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

Plain training's bytes are computed here; each technique's own (checkpointing, chunked
cross-entropy, activation offload, packing, the step in backward, FSDP2, ZeRO) are its module's
``memory`` and ``moments`` terms over a ``trials.techniques.terms.MemoryStep``.

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
)
from autotune.estimator.base import PARTS, Estimate, Estimator
from autotune.estimator.formulas import FORMULAS
from autotune.estimator.speed import roofline
from autotune.estimator.states import (
    adapter_shapes,
    deepspeed_states,
    estimator_states,
    host_with_activations,
    numel,
    pure_outside_deepspeed,
    qlora_shapes,
)
from autotune.estimator.workload import Workload
from autotune.models import stats_of
from trials.data import micro_shapes
from trials.techniques import TECHNIQUES
from trials.techniques.adapter import adapts
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.optimizer import step_choice
from trials.techniques.precision import computes_in_16_bits
from trials.techniques.quantization import quantizes
from trials.techniques.terms import MemoryStep


class AnalyticalEstimator(Estimator):
    name = "analytical"

    def estimate(self, workload: Workload, config: dict[str, Any]) -> Estimate:
        model_config, nproc, gpu = workload.model_config, workload.processes, workload.device
        documents = workload.documents
        st = stats_of(model_config)
        h, layers, vocab = st.hidden, st.layers, st.vocab
        _, accum = micro_and_accumulation(config, workload.global_batch_sequences, strict=False)
        # the largest micro-batch's rows (fixed-length data: micro-batch x sequence length)
        big = micro_shapes(
            config, workload.seq_len_tokens, workload.global_batch_sequences, documents, nproc
        )[0]
        micro, length = big.rows, big.length
        tokens = micro * length
        half = computes_in_16_bits(config)
        deepspeed = deepspeed_states(config)
        # the model itself in 16 bits (each technique's ``model_in_16_bits``): no autocast
        # copies of the weights, a 16-bit residual stream and logits
        pure = pure_outside_deepspeed(config)
        adapted = adapts(config)  # LoRA/DoRA: the base frozen (16-bit under bf16/fp16)
        model16 = deepspeed or TECHNIQUES.model_in_16_bits(config)
        states = estimator_states(workload, config)
        params = states.parts["parameters"]
        grads = states.parts["gradients"]
        optim = states.parts["optimizer_states"]

        layer_linear = st.layer_matrix_params + st.expert_params
        linear_params = layer_linear * layers
        head_params = vocab * h
        quantized = quantizes(config)
        # frozen quantized weights are dequantized per use, not kept as 16-bit copies
        cached_params = head_params + (0 if quantized else linear_params)
        weight_cache = 2 * cached_params if half and not model16 else 0
        layer_weight_cache = 2 * layer_linear if half and not quantized and not adapted else 0

        cuda = gpu is not None
        per_layer = layer_activation_bytes(st, config, length, micro, cuda)
        if adapted:
            per_layer += adapter_activation_bytes(st, config, tokens) // layers
        stream_width = 2 if model16 and half else 4  # the residual stream's dtype
        # the final norm (what the norm's kind keeps) and the head's input (its output, or under
        # autocast its 16-bit copy); the embedding's output is the first layer's input
        mode = "pure16" if model16 and half else "autocast" if half else "fp32"
        final_norm = NORM_BYTES[st.norm][mode] * h * tokens
        head_acts = final_norm + (2 if half else 4) * h * tokens
        if st.embd_dropout > 0:  # its mask (the output is the first layer's input)
            head_acts += dropout_mask_bytes(stream_width, cuda) * h * tokens
        largest = st.largest_param
        if adapted:  # the largest trainable tensor: an adapter's
            largest = max(numel(s) for s in adapter_shapes(st, config)[0])
        elif quantized:  # a quantized base's LoRA adapters (``states.qlora_shapes``)
            largest = max(numel(s) for s in qlora_shapes(st, config))
        step = MemoryStep(
            config=config,
            stats=st,
            formulas=FORMULAS,
            states=states,
            workload=workload,
            accum=accum,
            micro=micro,
            length=length,
            tokens=tokens,
            half=half,
            model16=model16,
            pure=pure,
            adapted=adapted,
            quantized=quantized,
            deepspeed=deepspeed,
            per_layer=per_layer,
            stream=stream_width * h * tokens,  # a layer's input
            layer_linear=layer_linear,
            head_params=head_params,
            weight_cache=weight_cache,
            layer_weight_cache=layer_weight_cache,
            final_norm=final_norm,
            grads=grads,
            gbytes=2 if pure else 4,  # a gradient's bytes per value (the parameter's dtype)
            largest=largest,
            step_temps=(
                step_choice(config).step_temporaries(largest, cuda, pure) if not deepspeed else 0
            ),
            # plain training: every layer's activations kept, the whole micro-batch's logits
            kept=layers * per_layer,
            head_acts=head_acts,
            logit_tokens=tokens,
        )
        TECHNIQUES.memory_terms(step)
        step.acts = step.kept + step.head_acts - step.head_on_host
        step.cache_in_fwd = weight_cache
        step.cache_in_bwd = weight_cache * (layers - step.n_ckpt) // max(1, layers)
        step.bwd_layers = step.bwd_inputs + step.recompute
        # under autocast 16-bit logits plus the fp32 log-softmax; DeepSpeed's 16-bit model keeps
        # its 16-bit logits and the loss's fp32 upcast
        step.fwd_logits = (6 if half and model16 else 10 if half else 8) * step.logit_tokens * vocab
        step.bwd_logits = 12 * step.logit_tokens * vocab + step.bwd_logits_extra
        acts, grads_before = step.acts, step.grads_before
        step.moments = {
            "end of forward": (grads_before, acts + step.cache_in_fwd, step.fwd_logits, 0),
            "start of backward": (grads_before, acts + step.cache_in_bwd, step.bwd_logits, 0),
            "end of backward": (grads, step.bwd_layers, 0, 0),
            "optimizer step": (grads, 0, 0, step.step_temps),
        }
        TECHNIQUES.moment_terms(step)
        peak, where, breakdown = -1, "", {k: 0 for k in PARTS}
        for name, (g, a, lg, tmp) in step.moments.items():
            if step.held is not None:  # what the engine holds in this phase
                held = step.held(name)
            else:
                held = {"parameters": params, "gradients": g, "optimizer_states": optim}
                held["temporaries"] = tmp
            if step.resident:
                held = {**held, "parameters": held["parameters"] + step.resident}
            total = sum(held.values()) + a + lg
            if total > peak:
                peak, where = total, name
                breakdown = {**held, "activations": a, "logits/loss": lg}
        host_acts = step.host_acts
        notes = [f"peak at {where}", *states.notes]
        host = host_with_activations(states.host, host_acts, workload, notes)
        est = Estimate(int(peak), breakdown, method=self.name, notes=notes, host_breakdown=host)
        if gpu is not None:
            roofline(est, workload, config, host_acts)
        return est
