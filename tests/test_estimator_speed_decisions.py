"""The estimator's speed decisions (``autotune/estimator/speed.py``: what each part of a step
costs), against hand computations and against what torch and DeepSpeed do on this machine: the
dtype of the gradient buckets a real ``DistributedDataParallel`` (gloo, one rank) all-reduces
under autocast, and the copy of the updated weights DeepSpeed's ZeRO-Offload makes after its
host step (seen by a dispatch mode, on the CPU). The memory decisions:
``tests/test_estimator_memory_decisions.py``.

The decisions, each with a test here that fails when it is inverted, swapped or fed the wrong
quantity:

1. DDP all-reduces its gradient buckets once per step in the dtype DDP keeps them: fp32 under
   autocast (the ring moves 2 (n - 1) / n of them), exposed beyond backward;
2. ZeRO-1/2 reduce-scatter the 16-bit gradients and all-gather the 16-bit weights;
3. ZeRO-Offload copies the updated 16-bit weights back to the device over PCIe after the host
   step (as many as the rank's shard holds), besides the gradients going out;
4. matmuls and attention run at the precision's peak rate (fp32's plain rate, bf16's tensor
   cores);
5. tokens/s: every rank's tokens of one optimizer step over the step time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GB, gpu_spec
from autotune.estimator.speed import COMM_EFFICIENCY, PCIE_EFFICIENCY, step_time
from autotune.estimator.workload import Workload
from autotune.models import resolve_model, stats_of

# --- what torch's DDP and DeepSpeed's ZeRO-Offload do, observed in a process of its own ---------

OBSERVE = r"""
import json
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils._python_dispatch import TorchDispatchMode
from trials.deepspeed_engine import ensure_distributed

ensure_distributed("cpu", deepspeed_comm=True)
out = {}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
ddp = DistributedDataParallel(model)
buckets = []

def hook(state, bucket):
    buckets.append(str(bucket.buffer().dtype).removeprefix("torch."))
    return allreduce_hook(state, bucket)

ddp.register_comm_hook(None, hook)
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = ddp(torch.randn(4, 64))
out["ddp_output"] = str(y.dtype).removeprefix("torch.")
y.float().square().sum().backward()
out["ddp_buckets"] = buckets

import deepspeed

class Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.seen.append([str(dst.dtype).removeprefix("torch."),
                              str(src.dtype).removeprefix("torch."), dst.numel()])
        return func(*args, **(kwargs or {}))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
config = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "bf16": {"enabled": True},
}
engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config
)
engine.backward(engine(torch.randn(1, 64, dtype=torch.bfloat16)).float().square().sum())
copies = Copies()
with copies:
    engine.step()
out["params"] = sum(p.numel() for p in model.parameters())
out["step_copies"] = copies.seen
print("OBSERVED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    ran = subprocess.run(
        [sys.executable, "-c", OBSERVE], env=env, capture_output=True, text=True, timeout=600
    )
    line = next((x for x in ran.stdout.splitlines() if x.startswith("OBSERVED ")), None)
    assert line is not None, ran.stdout[-2000:] + ran.stderr[-4000:]
    return json.loads(line.removeprefix("OBSERVED "))  # type: ignore[no-any-return]


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LLAMA7B = resolve_model("llama-7b").config
PSI = 6_738_415_616  # llama-7b's parameters


def _step(config: dict[str, Any], gpu: Any, nproc: int, seq: int = 512, batch: int = 1) -> Any:
    st = stats_of(LLAMA7B)
    assert st.n_params == PSI
    return step_time(Workload(LLAMA7B, seq, batch, nproc, gpu=gpu), config, layer_act_bytes=0)


def test_ddp_all_reduces_the_buckets_in_the_dtype_ddp_keeps_them(observed: dict) -> None:
    """Under bf16 autocast the forward runs in bf16, but DDP's buckets (the gradients of the
    fp32 parameters) are fp32. Two slow links, both exposing the all-reduce beyond backward:
    the communication time differs by 2 (n - 1) / n x bytes x parameters x (1/l1 - 1/l2)."""
    assert observed["ddp_output"] == "bfloat16"
    assert observed["ddp_buckets"] and set(observed["ddp_buckets"]) == {"float32"}
    nbytes = DTYPE_BYTES[observed["ddp_buckets"][0]]
    base = gpu_spec("a100-80gb")
    slow, slower = replace(base, nvlink_gbps=4.0), replace(base, nvlink_gbps=2.0)
    config = {"precision": "bf16", "zero_stage": 0, "micro_batch_size": 1}
    n = 2
    got = _step(config, slower, n).communication - _step(config, slow, n).communication
    ring = (n - 1) / n
    hand = (
        2
        * ring
        * nbytes
        * PSI
        * (1 / (2.0 * GB * COMM_EFFICIENCY) - 1 / (4.0 * GB * COMM_EFFICIENCY))
    )
    assert got == pytest.approx(hand, rel=1e-9)


def test_zero2_moves_16_bit_gradients_and_weights() -> None:
    """ZeRO-2 reduce-scatters the bf16 gradients and all-gathers the bf16 weights: 2 bytes a
    parameter each way, (n - 1) / n of them per rank, both exposed on slow links."""
    base = gpu_spec("a100-80gb")
    slow, slower = replace(base, nvlink_gbps=4.0), replace(base, nvlink_gbps=2.0)
    config = {"precision": "bf16", "zero_stage": 2, "micro_batch_size": 1}
    n = 2
    got = _step(config, slower, n).communication - _step(config, slow, n).communication
    hand = 2 * 0.5 * 2 * PSI * (1 / (2.0 * GB * COMM_EFFICIENCY) - 1 / (4.0 * GB * COMM_EFFICIENCY))
    assert got == pytest.approx(hand, rel=1e-9)


def test_zero_offload_prices_the_updated_weights_deepspeed_copies_back(observed: dict) -> None:
    """After its host step DeepSpeed copies the updated fp32 partition into the bf16 weights:
    one element per parameter, in the weights' dtype. On the GPU that copy crosses PCIe, and so
    do the gradients going out (copied in the reduction hooks on the compute stream, one
    micro-batch here), each in the dtype autograd gives a bf16 weight's gradient: two PCIe speeds
    differ by exactly those bytes over each."""
    ups = [c for c in observed["step_copies"] if c[1] == "float32" and c[0] != "float32"]
    assert sum(c[2] for c in ups) == observed["params"]
    nbytes = DTYPE_BYTES[ups[0][0]]
    assert nbytes == 2
    base = gpu_spec("a100-80gb")
    fast, slow = (replace(base, machine=replace(base.machine, pcie_gbps=b)) for b in (32.0, 16.0))
    config = {"precision": "bf16", "zero_stage": 2, "offload_optimizer": "cpu"}
    config["micro_batch_size"] = 8
    got = (
        _step(config, slow, 1, seq=2048, batch=8).offload
        - _step(config, fast, 1, seq=2048, batch=8).offload
    )
    weight = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    (weight.float() * 2).sum().backward()
    assert weight.grad is not None
    grad_bytes = weight.grad.element_size()
    per_byte = 1 / (16.0 * GB * PCIE_EFFICIENCY) - 1 / (32.0 * GB * PCIE_EFFICIENCY)
    hand = (grad_bytes + nbytes) * PSI * per_byte
    assert got == pytest.approx(hand, rel=1e-9)


def test_matmuls_run_at_the_precisions_peak_rate() -> None:
    """Compute-bound (8 x 2048 tokens): the compute time of fp32 over that of bf16 is the A100's
    bf16 over fp32 datasheet rate, 312 / 19.5."""
    gpu = gpu_spec("a100-80gb")
    fp32 = _step({"precision": "fp32", "micro_batch_size": 8}, gpu, 1, seq=2048, batch=8)
    bf16 = _step({"precision": "bf16", "micro_batch_size": 8}, gpu, 1, seq=2048, batch=8)
    assert fp32.compute / bf16.compute == pytest.approx(312 / 19.5, rel=1e-9)


def test_tokens_per_second_count_every_ranks_tokens_of_a_step() -> None:
    est = AnalyticalEstimator().estimate(
        Workload(
            LLAMA7B,
            seq_len_tokens=1024,
            global_batch_sequences=4,
            processes=4,
            gpu=gpu_spec("a100-80gb"),
        ),
        {"precision": "bf16", "zero_stage": 2, "micro_batch_size": 2},
    )
    assert est.tokens_per_s * est.step_time_s == pytest.approx(4 * 1024 * 4, rel=1e-12)
