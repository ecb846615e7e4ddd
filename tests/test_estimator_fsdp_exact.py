"""FSDP2's model states (``_fsdp_states`` through ``model_states``) and what a rank holds moment
by moment (``fsdp_held``), exactly, by hand on tiny-llama, against oracles from outside
``autotune/estimator/states.py``: the tensors torch's ``fully_shard`` keeps on a rank
(torch/distributed/fsdp/_fully_shard: fp32 shards of the parameters, their gradients and the
optimizer's states; ``CPUOffloadPolicy`` pins those shards themselves in host memory; a
``MixedPrecisionPolicy`` gathers 2-byte copies of them), the optimizers' own states (torch's
AdamW: two fp32 moments; lion-pytorch's Lion: one), and what a user of the figures relies on
(whole bytes, the four roles, the notes).

tiny-llama: 7,358,720 parameters; 4 blocks of 791,040; the root (embedding, head, final norm)
4,194,560; the head 8,192 x 256 = 2,097,152, the largest tensor. FSDP2 shards each tensor by
rows (``torch.chunk`` on dim 0, every rank's chunk padded to the first's): every first
dimension of tiny-llama is even, so on one or two ranks a rank's shards are exactly 1/N of the
model; on 3 or 7 ranks they lie between the even split and the padded chunks."""

from __future__ import annotations

import math

import pytest

from autotune.estimator.states import fsdp_held, model_states
from autotune.models import stats_of
from tests.conftest import TINY
from tests.test_technique_fsdp import PARAMS

BLOCK = 791_040  # one decoder layer
ROOT = 4_194_560  # embedding, head and final norm: fully_shard on the root module
HEAD = 8_192 * 256  # the output layer, the largest tensor
ROLES = {"parameters", "gradients", "optimizer_states", "temporaries"}
MOMENTS = (
    "end of forward",
    "start of backward",
    "first layer's backward",
    "end of backward",
    "optimizer step",
)
OFFLOAD_NOTE = "parameter shards, their gradients and optimizer states in host memory"


def _held(config: dict, moment: str, n: int, accum: int = 1, cuda: bool = False) -> tuple:
    h = fsdp_held(stats_of(TINY), config, n, moment, accum, cuda)
    assert set(h) == ROLES, h
    return h["parameters"], h["gradients"], h["optimizer_states"], h["temporaries"]


def _padded(n: int) -> int:
    """Elements of a rank's padded shards (``torch.chunk``'s first chunk of every tensor)."""
    return sum(-(-s[0] // n) * math.prod(s[1:]) for s in stats_of(TINY).shapes)


def test_tiny_llama_is_counted_as_by_hand() -> None:
    st = stats_of(TINY)
    assert (st.n_params, st.layer_params, st.layers) == (PARAMS, BLOCK, 4)
    assert PARAMS - 4 * BLOCK == ROOT
    assert (st.largest_param, st.vocab * st.hidden) == (HEAD, HEAD)


@pytest.mark.parametrize("mode", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 2])
def test_fsdp2_parts_are_fp32_shards_by_hand(mode: str, precision: str, n: int) -> None:
    """Each rank keeps fp32 shards of the parameters (4 B/param / N), of their gradients (4 B /
    N) and AdamW's two fp32 moments (8 B / N), in bf16 too (the policy's bf16 copies are
    gathered, not kept); the host holds the fp32 model each of the N processes builds at load,
    with no DeepSpeed slack; the figures replace the single-process trace's."""
    states = model_states(TINY, {"fsdp": mode, "precision": precision}, n)
    assert states.parts == {
        "parameters": 4 * PARAMS // n,
        "gradients": 4 * PARAMS // n,
        "optimizer_states": 8 * PARAMS // n,
    }
    assert states.host == {
        "offloaded states": 0,
        "model copy at load": 4 * PARAMS * n,
        "pinned buffers and slack": 0,
    }
    assert states.replaces_trace is True
    assert states.notes == [f"model states: FSDP2 {mode} over {n} GPU(s) by formula"]


@pytest.mark.parametrize("n", [3, 7])
def test_fsdp2_parts_on_ranks_that_do_not_divide_the_model(n: int) -> None:
    """On 3 or 7 ranks a rank's fp32 shards are whole elements, at least the even split (some
    rank holds that much) and at most ``torch.chunk``'s padded first chunk of every tensor."""
    assert PARAMS % n
    parts = model_states(TINY, {"fsdp": "full_shard"}, n).parts
    assert all(type(x) is int for x in parts.values()), parts
    for role, nbytes in (("parameters", 4), ("gradients", 4), ("optimizer_states", 8)):
        assert nbytes * (PARAMS // n) <= parts[role] <= nbytes * _padded(n), role


@pytest.mark.parametrize(("nproc", "nodes"), [(2, 1), (2, 2), (1, 1)])
@pytest.mark.parametrize("cuda", [True, False])
def test_fsdp2_offloaded_shards_are_pinned_on_the_host(nproc: int, nodes: int, cuda: bool) -> None:
    """``CPUOffloadPolicy`` moves each rank's fp32 parameter shards, their gradients and
    AdamW's two moments, (4 + 4 + 8) B x 7,358,720 / N, to the host and pins them themselves
    (factor 1, no staging buffers, no DeepSpeed slack): per host, that times the ranks on it
    (two ranks on one host or one on each of two; measured on two CPU ranks: 16 B x 7,358,720 /
    2 per rank, ``test_offloaded_shards_are_host_memory``). The model copy each process builds
    at load (4 B/param) is the same memory first, counted only where larger. Nothing of the
    states stays on the device, with or without CUDA."""
    per_host = nproc // nodes
    states = model_states(
        TINY, {"fsdp": "full_shard", "fsdp_offload": "cpu"}, nproc, nodes=nodes, cuda=cuda
    )
    assert states.parts == {"parameters": 0, "gradients": 0, "optimizer_states": 0}
    offloaded = 16 * PARAMS // nproc * per_host
    assert (
        offloaded == {(2, 1): 117_739_520, (2, 2): 58_869_760, (1, 1): 117_739_520}[(nproc, nodes)]
    )
    assert states.host == {
        "offloaded states": offloaded,
        "model copy at load": 0,  # 4 B/param per process, less than the 16 offloaded
        "pinned buffers and slack": 0,
    }
    assert states.host_bytes == offloaded
    assert states.replaces_trace is True
    assert states.notes == [
        f"model states: FSDP2 full_shard over {nproc} GPU(s) by formula",
        OFFLOAD_NOTE,
    ]


def test_fsdp2_lion_keeps_one_fp32_moment_per_shard() -> None:
    """Lion (lion-pytorch, as the job builds it) keeps one moment, ``exp_avg``, in the
    parameters' fp32: 4 B/param / N per rank, in the model states, in what a rank holds at
    every moment, and on the host offloaded ((4 + 4 + 4) B/param / N per rank)."""
    lion = {"fsdp": "full_shard", "optimizer": "lion"}
    for n in (1, 2):
        assert model_states(TINY, lion, n).parts["optimizer_states"] == 4 * PARAMS // n
        for moment in MOMENTS:
            for cuda in (True, False):
                assert _held(lion, moment, n, cuda=cuda)[2] == 4 * PARAMS // n, (n, moment)
                assert _held({**lion, "fsdp_offload": "cpu"}, moment, n, cuda=cuda)[2] == 0
    host = model_states(TINY, {**lion, "fsdp_offload": "cpu"}, 2).host
    assert host["offloaded states"] == 12 * PARAMS // 2 * 2


def test_fsdp2_one_rank_bf16_by_hand() -> None:
    """One rank in bf16: the policy gathers 2-byte copies of the fp32 shards (the root's from
    its forward to its backward, a block and the next prefetched in backward), but one rank has
    no collective: no gloo fp32 copy of the gradients on a CPU, and no gloo buffers at the end
    of backward, where the root's parameters are resharded before its gradients are reduced
    (``FSDPParamGroup.post_backward``). The reduce copies its fp32 input (4 B of the root) to
    its output (another 4 B: ``foreach_reduce``'s world-size-1 path), larger than the copy-in
    (2 B of the root's gradient beside its 4 B fp32 input). At the step, AdamW's fp32
    temporaries of the whole head (two on a CPU, one with CUDA's foreach path)."""
    # chunked cross-entropy: the head's gradient is summed slice by slice beside the logits'
    bf16 = {"fsdp": "full_shard", "precision": "bf16", "cross_entropy": "chunked"}
    shards, moments, reduced = 4 * PARAMS, 8 * PARAMS, 4 * (PARAMS - ROOT)
    for cuda in (False, True):
        assert _held(bf16, "end of forward", 1, cuda=cuda) == (shards + 2 * ROOT, 0, moments, 0)
        assert _held(bf16, "start of backward", 1, cuda=cuda) == (
            shards + 2 * ROOT,
            2 * HEAD,
            moments,
            0,
        )
        assert _held(bf16, "first layer's backward", 1, cuda=cuda) == (
            shards + 2 * ROOT + 2 * 2 * BLOCK,
            reduced + 2 * HEAD,
            moments,
            (2 + 4) * BLOCK,  # the gathered bf16 gradient and its fp32 copy, no gloo copy
        )
        assert _held(bf16, "end of backward", 1, cuda=cuda) == (
            shards,
            reduced,
            moments,
            (4 + 4) * ROOT,
        )
        temporaries = (1 if cuda else 2) * 4 * HEAD
        assert _held(bf16, "optimizer step", 1, cuda=cuda) == (
            shards,
            shards,
            moments,
            temporaries,
        )


def test_fsdp2_one_rank_bf16_offloaded_by_hand() -> None:
    """One rank in bf16 with the shards on the host: the device holds only what is gathered
    and the gradients in flight. At the end of backward the reduce's fp32 input (4 B of the
    root) is copied to its output (4 B more) with CUDA; on a CPU the output is the host
    gradient itself (``.to("cpu")`` of a CPU tensor is no copy), so the copy-in (2 + 4 B of
    the root) is the most. The step runs on the host: nothing on the device."""
    off = {"fsdp": "full_shard", "precision": "bf16", "fsdp_offload": "cpu"}
    assert _held(off, "end of backward", 1, cuda=False) == (0, 0, 0, (2 + 4) * ROOT)
    assert _held(off, "end of backward", 1, cuda=True) == (0, 0, 0, (4 + 4) * ROOT)
    for cuda in (False, True):
        assert _held(off, "first layer's backward", 1, cuda=cuda) == (
            2 * ROOT + 2 * 2 * BLOCK,
            2 * HEAD,
            0,
            (2 + 4) * BLOCK,
        )
        assert _held(off, "optimizer step", 1, cuda=cuda) == (0, 0, 0, 0)
        assert _held(off, "end of forward", 1, cuda=cuda) == (2 * ROOT, 0, 0, 0)


def test_fsdp2_fp16_is_gathered_as_bf16() -> None:
    """fp16 is a 2-byte ``param_dtype`` as bf16 is (the policy takes the precision's autocast
    dtype): a rank holds the same at every moment, 2 B of the root gathered."""
    for n in (1, 2, 3):
        for moment in MOMENTS:
            for accum in (1, 2):
                for cuda in (False, True):
                    for extra in ({}, {"fsdp_offload": "cpu"}, {"fsdp": "shard_grad_op"}):
                        fp16 = {"fsdp": "full_shard", "precision": "fp16", **extra}
                        bf16 = {**fp16, "precision": "bf16"}
                        assert _held(fp16, moment, n, accum, cuda) == _held(
                            bf16, moment, n, accum, cuda
                        ), (n, moment, accum, cuda, extra)
    fp16 = {"fsdp": "full_shard", "precision": "fp16"}
    assert _held(fp16, "end of forward", 2) == (4 * PARAMS // 2 + 2 * ROOT, 0, 8 * PARAMS // 2, 0)


def test_fsdp2_step_on_seven_ranks_takes_the_largest_shard_rounded_up() -> None:
    """At the step AdamW's fp32 temporaries are those of the largest tensor's shard: the head's
    2,097,152 = 7 x 299,593 + 1 elements over 7 ranks leave some rank at least 299,594 (and
    ``torch.chunk``'s 1,171 of 8,192 rows, 299,776, at most); on one rank the whole head."""
    fp32 = {"fsdp": "full_shard"}
    assert HEAD == 7 * 299_593 + 1
    for cuda, temporaries in ((False, 2), (True, 1)):
        step = _held(fp32, "optimizer step", 7, cuda=cuda)[3]
        assert temporaries * 4 * 299_594 <= step <= temporaries * 4 * 1_171 * 256, cuda
        assert step % (temporaries * 4) == 0
        assert _held(fp32, "optimizer step", 1, cuda=cuda)[3] == temporaries * 4 * HEAD


CONFIGS = [
    {"fsdp": "full_shard"},
    {"fsdp": "shard_grad_op"},
    {"fsdp": "full_shard", "precision": "bf16"},
    {"fsdp": "shard_grad_op", "precision": "bf16"},
    {"fsdp": "full_shard", "fsdp_offload": "cpu"},
    {"fsdp": "full_shard", "fsdp_offload": "cpu", "precision": "bf16"},
    {"fsdp": "full_shard", "optimizer": "lion"},
]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_fsdp2_held_is_whole_bytes_by_role(n: int) -> None:
    """Every figure a rank holds, at every moment, accumulating or not, on CUDA or a CPU, is a
    whole number of bytes (an int: shards are whole elements) under the four roles, and so are
    the model states and host bytes, on any number of ranks over one host or N."""
    for config in CONFIGS:
        for moment in MOMENTS:
            for accum in (1, 2):
                for cuda in (False, True):
                    held = _held(config, moment, n, accum, cuda)
                    assert all(type(x) is int for x in held), (config, moment, accum, cuda, held)
        for nodes in (1, n):
            states = model_states(TINY, config, n, nodes=nodes)
            figures = [*states.parts.values(), *states.host.values()]
            assert all(type(x) is int for x in figures), (config, nodes, figures)
