"""Building a trial's model so that construction never needs more memory than training.

The model is made from its config without any weight initialisation (transformers'
``no_init_weights``), in the dtype and place the engine trains it in: on the device in fp32 for
torch autocast (fp32 master weights), in 16 bits for DeepSpeed's bf16/fp16 engines (which keep
their fp32 master copy themselves), under ``deepspeed.zero.Init`` for ZeRO-3 (each layer is
partitioned, and with ``offload_param`` sent to host memory, as soon as it is made), on the host
for quantized runs (the weights reach the device already quantized). See ``trials.engines``.

Then every module's weights are initialised by transformers' own ``_init_weights`` from a seed
derived from (seed, module name): the initial weights depend on neither the construction path
nor the order modules are visited, so a ZeRO-3 trial starts from exactly the plain trial's
weights. Under ZeRO-3 each module's parameters are gathered for their initialisation only
(as transformers' ``initialize_weights_zero3`` does), one module at a time.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

from trials.techniques.attention import ATTENTION
from trials.weights import load_weights

#: ``params -> context`` in which those parameters are whole (ZeRO-3's GatheredParameters)
Gather = Callable[[list[nn.Parameter]], ContextManager[Any]]


def module_seed(seed: int, name: str) -> int:
    """The RNG seed for one module's initial weights: stable across processes and runs."""
    return zlib.crc32(f"{seed}:{name}".encode())


def initialize(model: nn.Module, seed: int, gather: Gather | None = None) -> None:
    """Initialise every module's own parameters with transformers' ``_init_weights`` (the model
    class's initialisation scheme, the documented hook of ``PreTrainedModel``), each module from
    its own seed."""
    init_weights = model._init_weights
    with torch.no_grad():
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue  # buffers such as RoPE's inv_freq are computed by the constructor
            with gather(params) if gather is not None else contextlib.nullcontext():
                torch.manual_seed(module_seed(seed, name))
                init_weights(module)  # type: ignore[operator]
    torch.manual_seed(seed)


def build_model(
    model_config: dict[str, Any],
    attention: str,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    init_context: ContextManager[Any] | None = None,
    gather: Gather | None = None,
    weights: str | None = None,
) -> nn.Module:
    """A transformers causal LM from a config dict, its weights a function of ``seed`` alone.

    Built where the caller's context puts it (``with torch.device(...)``, or ``init_context``
    such as ``deepspeed.zero.Init``), in ``dtype``, never initialised twice; with ``weights`` (a
    model folder) its weights are the checkpoint's instead (``trials.weights``).
    """
    # imported before any init context is entered: deepspeed.zero.Init patches tensor
    # constructors, which torch._dynamo (imported by transformers' modeling code) refuses
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = dict(model_config)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    with no_init_weights(), init_context or contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTENTION[attention], dtype=dtype
        )
    if weights:
        load_weights(model, weights, gather)
    else:
        initialize(model, seed, gather)
    return model
