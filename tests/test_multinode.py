"""Multi-node trials on one machine: two torchrun agents that meet through c10d on 127.0.0.1
(gloo), as two nodes' agents meet on the first node's address. Real DeepSpeed ZeRO-3 across
them; a rank that runs out of memory on one "node" ends the whole trial within seconds.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli import main
from autotune.estimator.workload import Workload
from autotune.runner import SubprocessRunner, merge_ranks
from tests.conftest import tiny_spec
from trials.spec import TrialResult

SMALL_BUCKETS = {"reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000}


def _zero3(**kw: object):  # type: ignore[no-untyped-def]
    return tiny_spec(
        {"micro_batch_size": 4, "zero_stage": 3, **SMALL_BUCKETS},
        seq_len=16,
        global_batch_size=4,
        measured_steps=1,
        nproc=2,
        nodes=2,
        **kw,
    )


@pytest.mark.slow
def test_two_nodes_train_exactly_as_one_node_with_two_ranks(tmp_path: Path) -> None:
    """ZeRO-3 over two "nodes" of one rank each is the same computation as over one node of two
    ranks (the same shards of the same tokens): the merged losses agree, and the runner merged
    what each rank wrote."""
    runner = SubprocessRunner(tmp_path, timeout_s=400)
    result = runner.run(_zero3(), "two-nodes")
    assert result.status == "ok", result.error + result.stderr_tail
    ranks = [TrialResult.load(tmp_path / "two-nodes" / f"result.rank{r}.json") for r in (0, 1)]
    assert result.rank_peaks == [r.peak_bytes for r in ranks]
    assert result.peak_bytes == max(r.peak_bytes for r in ranks)
    assert result.tokens_per_s == pytest.approx(sum(r.tokens_per_s for r in ranks))
    one_node = runner.run(dataclasses.replace(_zero3(), nodes=1), "one-node")
    assert one_node.status == "ok", one_node.error + one_node.stderr_tail
    assert result.losses == pytest.approx(one_node.losses, rel=1e-5)


def test_oom_on_one_node_ends_the_trial_within_seconds(tmp_path: Path) -> None:
    """Only rank 1 (the second "node") gets a budget it cannot meet: it runs out of memory, and
    rank 0, waiting for it in a collective, is stopped at once; the trial is an OOM."""
    budget = 2 * 2**30  # rank 0's: far more than it needs
    spec = _zero3(budget=budget)
    spec.rank_budget_bytes = {"1": 40 * 2**20}
    result = SubprocessRunner(tmp_path, timeout_s=400).run(spec, "oom")
    ended = time.time()
    assert result.status == "oom", result.error + result.stderr_tail
    oom_file = tmp_path / "oom" / "result.rank1.json"
    assert TrialResult.load(oom_file).status == "oom"
    # the OOM rank wrote its result; everything else was stopped within seconds of that
    assert ended - os.path.getmtime(oom_file) < 20
    rank0 = tmp_path / "oom" / "result.rank0.json"
    assert not rank0.is_file() or TrialResult.load(rank0).status != "ok"


# --- the estimate backend plans nodes -----------------------------------------------------------


def test_zero_communication_across_nodes_is_priced_on_the_nodes_network() -> None:
    """32 H100s as 4 nodes of 8: ZeRO-3's collectives (two all-gathers and a reduce-scatter of
    the 16-bit weights per micro-batch: 3 x 2 B x Psi x 31/32) go through each GPU's share of its
    node's InfiniBand (8 x 400 Gb/s NICs for 8 GPUs: 50 GB/s), not NVLink (450 GB/s), both at
    the speed model's collective efficiency (0.70). At 128 tokens per GPU the collectives outlast
    the compute they overlap with on either network, so the whole difference is exposed.
    Device memory does not depend on where the ranks are; host memory is per node (8 processes
    each build their share of the model instead of 32)."""
    from autotune.estimator.analytical import AnalyticalEstimator
    from autotune.estimator.gpus import gpu_spec
    from autotune.models import MODELS

    entry = MODELS["llama-70b"]
    config = {
        "zero_stage": 3,
        "precision": "bf16",
        "micro_batch_size": 1,
        "gradient_checkpointing": "full",
        "attention": "sdpa",
        "optimizer": "adamw",
    }
    kw = {"seq_len_tokens": 128, "global_batch_sequences": 1, "processes": 32}
    h100 = gpu_spec("h100")
    one_domain = AnalyticalEstimator().estimate(Workload(entry.config, gpu=h100, **kw), config)
    four_nodes = AnalyticalEstimator().estimate(
        Workload(entry.config, gpu=h100.spanning(4, 8), **kw), config
    )
    volume = 3 * 2 * entry.n_params * 31 / 32
    ib_per_gpu, nvlink = 8 * 400e9 / 8 / 8, 450e9  # bytes/s: 8 NICs of 400 Gb/s for 8 GPUs
    expected = (volume / ib_per_gpu - volume / nvlink) / 0.70
    assert four_nodes.step_time_s - one_domain.step_time_s == pytest.approx(expected, rel=1e-3)
    assert four_nodes.time_breakdown["compute"] == one_domain.time_breakdown["compute"]
    assert four_nodes.peak_bytes == one_domain.peak_bytes
    # host: zero.Init builds partitioned, each process holding the largest layer (the 32000 x
    # 8192 embedding) in fp32 at load, times DeepSpeed's 1.5 host buffer factor; 8 per node
    assert four_nodes.host_bytes == 1.5 * 4 * 32000 * 8192 * 8
    assert one_domain.host_bytes == 4 * four_nodes.host_bytes
    # within one node nothing changes
    assert h100.spanning(1, 8).interconnect_gbps == h100.interconnect_gbps


def test_run_plans_a_multi_node_study_without_a_gpu(in_tmp: Path) -> None:
    from tests.conftest import cli

    out = cli(
        "run",
        "--model",
        "llama-7b",
        "--budget",
        "24GB",
        "--backend",
        "estimate",
        "--gpu",
        "a100-40gb",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--trials",
        # enough sampled trials that one is priced for the network: on 24 GB ZeRO-1 + offload
        # no longer fits llama-7b (its 16-bit gradients stay whole on the GPU), so the first
        # three are all ZeRO-3, whose gathers the compute hides (the space with per-op
        # checkpointing, chunked cross-entropy and pure bf16 needed more than 5)
        "10",
    )
    assert out.exit_code == 0, out.output
    assert "llama-7b-24GB-estimate-2x8" in out.output
    import optuna

    study = optuna.load_study(
        study_name="llama-7b-24GB-estimate-2x8", storage="sqlite:///autotune.db"
    )
    settings = study.user_attrs["settings"]
    assert settings["nproc"] == 16 and settings["nodes"] == 2
    assert all(t.user_attrs.get("predicted") for t in study.trials)
    # every prediction (the sampled trials and each class's best) is priced for 2 nodes of 8
    from autotune.estimator.analytical import AnalyticalEstimator
    from autotune.estimator.gpus import gpu_spec

    a100 = gpu_spec("a100-40gb")
    kw = {
        "seq_len_tokens": settings["seq_len"],
        "global_batch_sequences": settings["global_batch_size"],
    }
    differs = 0
    for t in study.trials:
        if not t.values or not t.values[0]:  # over the budget: nothing to compare
            continue
        config, speed = t.user_attrs["config"], t.values[0]
        spanned = AnalyticalEstimator().estimate(
            Workload(settings["model_config"], processes=16, gpu=a100.spanning(2, 8), **kw), config
        )
        one_node = AnalyticalEstimator().estimate(
            Workload(settings["model_config"], processes=16, gpu=a100, **kw), config
        )
        assert speed == pytest.approx(spanned.tokens_per_s)
        differs += speed != pytest.approx(one_node.tokens_per_s)
    assert differs, "no prediction paid for the nodes' network"


def test_rank_results_merge_host_memory_per_node() -> None:
    """Four ranks on two nodes (torchrun numbers a node's ranks together): the host peak is the
    fuller node's (3 + 4 GB), not all four ranks' (10 GB) as on one machine."""
    ranks = [TrialResult("ok", host_peak_bytes=g * 10**9, losses=[1.0]) for g in (1, 2, 3, 4)]
    assert merge_ranks(ranks, nodes=2).host_peak_bytes == 7 * 10**9
    assert merge_ranks(ranks).host_peak_bytes == 10 * 10**9
    ranks[0] = TrialResult("oom", host_peak_bytes=10**9, error="out of memory")
    assert merge_ranks(ranks, nodes=4).host_peak_bytes == 4 * 10**9


def test_a_slurm_job_with_one_failed_rank_keeps_that_ranks_error(tmp_path: Path) -> None:
    """srun stopped the other ranks after one failed: the trial is that rank's failure with its
    own error (as the local runner keeps it), not a generic "Slurm job FAILED"."""
    from autotune.launchers import JobState, SlurmOptions, SlurmRunner
    from trials.spec import rank_result_path

    spec = dataclasses.replace(tiny_spec({}), nproc=2, nodes=2)
    runner = SlurmRunner(tmp_path, SlurmOptions())
    result_path = tmp_path / "trial-0" / "result.json"  # where a Slurm trial's job writes
    result_path.parent.mkdir(parents=True)
    bad = TrialResult("failed", error="ValueError: an unsupported combination")
    rank_result_path(result_path, 1, 2).write_text(bad.to_json())
    result = runner.collect("42", JobState("FAILED", exit_code="17:0"), spec, "trial-0")
    assert result.status == "failed" and "unsupported combination" in result.error
    assert not result.transient  # the configuration's failure: learned, never run again


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2"], "--nproc-per-node P (CPU)"),
        (["--nodes", "2", "--nproc", "2"], "--nproc is for one node"),
        (["--nodes", "2", "--gpus-per-node", "2"], "--gpus-per-node needs the cuda backend"),
        (["--partition", "gpu"], "--partition is a Slurm option"),
    ],
)
def test_bad_layouts_are_one_line(in_tmp: Path, args: list[str], message: str) -> None:
    out = CliRunner().invoke(
        main, ["run", "--model", "tiny-llama", "--budget", "300MB", "--seq-len", "64", *args]
    )
    assert out.exit_code == 2 and message in out.output, out.output
    assert "Traceback" not in out.output and not (in_tmp / "autotune.db").exists()
