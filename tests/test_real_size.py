"""Trials that build, fail and measure like a real job at real size.

Real parts: real DeepSpeed ZeRO-3 on the CPU (gloo), real torchrun ranks, real SQLite and Optuna,
real subprocesses. The pure CUDA functions are checked against the error texts the libraries
print (cuBLAS, cuDNN, NCCL).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

from autotune.availability import Hardware
from autotune.runner import SubprocessRunner, merge_ranks, new_trial_dir, trial_env
from autotune.space import SearchSpace
from autotune.storage import open_storage
from autotune.study import (
    Objective,
    ResultNotStored,
    StudySettings,
    create_or_load,
    fail_running_trials,
    make_sampler,
    workdir_for,
)
from tests.conftest import TINY, tiny_spec
from trials.build import build_model
from trials.cuda import (
    alloc_conf_with,
    allocator_fraction,
    capped,
    card_bytes,
    is_oom_message,
    measured_tokens,
    over_card_budget,
    scaler_skipped,
)
from trials.engines import DeepSpeedEngine
from trials.job import run_trial
from trials.memory import CpuMemoryMonitor
from trials.spec import TrialResult, TrialSpec

MIB = 2**20
#: a scale replica of a real LLaMA: the real architecture, 91M parameters, fp32 weights 348 MiB
REPLICA = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "use_cache": False,
}
FULL_OFFLOAD = {
    "zero_stage": 3,
    "offload_param": "cpu",
    "offload_optimizer": "cpu",
    "reduce_bucket_size": 5_000_000,
}


#: under the replica's fp32 weights (348 MiB); ZeRO-3 with both offloads peaks at 324 MiB here
#: (its 10 MB bf16 reduce bucket lives on the device, as DeepSpeed allocates it)
REPLICA_BUDGET = 336 * MIB


def _replica_spec(config: dict[str, Any], budget: int) -> TrialSpec:
    base = {"gradient_checkpointing": "off", "attention": "sdpa", "optimizer": "adamw"}
    return TrialSpec(
        model_config=REPLICA,
        config={**base, "micro_batch_size": 1, **config},
        seq_len=16,
        global_batch_size=1,
        budget_bytes=budget,
        warmup_steps=2,
        measured_steps=1,
        lr=3e-3,
    )


# --- 1. construction never above steady state --------------------------------------------------


def test_replica_fp32_weights_exceed_the_budget() -> None:
    n = 32000 * 1024 * 2 + 2 * (4 * 1024 * 1024 + 3 * 1024 * 2816) + (2 * 2 + 1) * 1024
    with torch.device("meta"):
        model = build_model(REPLICA, "sdpa", 0)
    assert sum(p.numel() for p in model.parameters()) == n  # hand count: ~91M
    assert 4 * n > REPLICA_BUDGET  # its fp32 weights alone are over the budget used below


@pytest.mark.slow
def test_replica_fits_under_zero3_full_offload_and_not_without() -> None:
    budget = REPLICA_BUDGET
    zero = run_trial(_replica_spec({**FULL_OFFLOAD, "precision": "bf16"}, budget))
    assert zero.status == "ok", zero.error
    assert 0 < zero.construction_peak_bytes <= zero.training_peak_bytes <= budget
    assert zero.peak_bytes == zero.training_peak_bytes
    plain = run_trial(_replica_spec({"precision": "bf16"}, budget))
    assert plain.status == "oom"  # the same model without ZeRO: fp32 weights alone
    assert plain.construction_peak_bytes > budget and plain.training_peak_bytes == 0


@pytest.mark.slow
def test_replica_fits_under_fsdp2_offload_and_not_without() -> None:
    """FSDP2 with its shards offloaded trains the replica (fp32 weights and AdamW states 1.4 GB)
    in 400 MiB; plain bf16 training does not. The shards are host memory from birth (nothing
    on the device while the model is sharded), and the host holds at least the fp32 weights
    and AdamW's two moments (12 B per parameter, by hand). (At the 336 MiB of the ZeRO-3 test it
    does not fit: FSDP2 gathers the root's 32000 x 1024 embedding and head whole, measured
    393,222,280 B.)"""
    budget = 400 * MIB
    n = 32000 * 1024 * 2 + 2 * (4 * 1024 * 1024 + 3 * 1024 * 2816) + (2 * 2 + 1) * 1024
    offload = {"precision": "bf16", "fsdp": "full_shard", "fsdp_offload": "cpu"}
    fsdp = run_trial(_replica_spec(offload, budget))
    assert fsdp.status == "ok", fsdp.error
    assert fsdp.construction_peak_bytes == 0
    assert fsdp.training_peak_bytes <= budget
    assert fsdp.memory_breakdown["host_offloaded"] >= 12 * n
    plain = run_trial(_replica_spec({"precision": "bf16"}, budget))
    assert plain.status == "oom"


def test_zero3_builds_partitioned_on_the_host_with_the_plain_weights() -> None:
    spec = tiny_spec({**FULL_OFFLOAD, "reduce_bucket_size": 500_000, "micro_batch_size": 4})
    plain = build_model(TINY, "sdpa", spec.seed)
    monitor = CpuMemoryMonitor(None)
    with monitor:
        model = DeepSpeedEngine.build(spec, torch.device("cpu"), monitor)
    weights = sum(p.numel() * 4 for p in plain.parameters())
    largest = max(p.numel() * 4 for p in plain.parameters())
    # one layer at a time on the device; every partition in host memory
    assert monitor.peak_bytes <= largest + MIB
    assert monitor.host_offloaded_bytes >= weights
    import deepspeed

    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.numel() == 0, name  # partitioned
        with deepspeed.zero.GatheredParameters([p]):
            assert torch.equal(p.data, q.data), name  # the same seed, the same weights


def test_same_seed_same_weights_other_seed_others() -> None:
    a, b, c = (build_model(TINY, "sdpa", s) for s in (0, 0, 1))
    pairs = list(zip(a.parameters(), b.parameters(), c.parameters(), strict=True))
    assert all(torch.equal(x, y) for x, y, _ in pairs)
    assert all(not torch.equal(x, z) for x, _, z in pairs if x.numel() > 1024)
    # transformers' scheme: Linear/Embedding ~ N(0, initializer_range), norms at one
    emb = a.get_input_embeddings().weight
    assert abs(float(emb.detach().std()) - 0.02) < 1e-3
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


def test_plain_trial_records_both_peaks() -> None:
    result = run_trial(tiny_spec({"micro_batch_size": 4}, seq_len=32))
    assert result.status == "ok", result.error
    assert 4 * 7_358_720 <= result.construction_peak_bytes < result.training_peak_bytes
    assert result.peak_bytes == result.training_peak_bytes


def test_host_allocations_and_deferred_budget() -> None:
    monitor = CpuMemoryMonitor(10_000)
    with monitor:
        with monitor.host_allocations():
            host = torch.empty(5_000)  # 20 kB on the host: not against the device budget
        device = torch.empty(1_000)
        assert monitor.live_bytes == 4_000 and monitor.host_offloaded_bytes == 20_000
        with pytest.raises(torch.OutOfMemoryError), monitor.deferred_budget():
            late = torch.empty(3_000)  # 12 kB: over, found when the block ends
        del host, device, late


# --- 2. failures are learned ---------------------------------------------------------------------

CRASH_JOB = (
    "import json, sys; from trials.spec import TrialResult, TrialSpec\n"
    "spec = TrialSpec.load(sys.argv[1])\n"
    "open(sys.argv[1] + '.ran', 'w').write(json.dumps(spec.config))\n"
    "if spec.config['attention'] == 'eager': raise NotImplementedError('eager: unsupported here')\n"
    "peak = 10_000_000 * spec.config['micro_batch_size']\n"
    "open(sys.argv[2], 'w').write(TrialResult('ok', peak, 1000.0 / peak, [1.0, 0.5]).to_json())\n"
)


class ScriptRunner(SubprocessRunner):
    def __init__(self, workdir: Path, code: str) -> None:
        super().__init__(workdir, timeout_s=60)
        self.code = code

    def command(self, spec_path: Path, result_path: Path) -> list[str]:
        return [sys.executable, "-c", self.code, str(spec_path), str(result_path)]


SPACE = {
    "dimensions": {
        "attention": {"choices": ["sdpa", "eager"]},
        "micro_batch_size": {"choices": [1, 2, 4]},
    }
}


def _study(url: str, name: str = "s", budget: int = 10**9) -> optuna.Study:
    settings = StudySettings(
        model="tiny-llama",
        model_config=TINY,
        budget_bytes=budget,
        budget_label="1GB",
        backend="cpu",
        seq_len=16,
        global_batch_size=4,
        space=SPACE,
    )
    return create_or_load(open_storage(url), name, settings)


@pytest.mark.parametrize("strategy", ["autotune", "tpe", "random"])
def test_a_crashing_configuration_runs_at_most_once(tmp_path: Path, strategy: str) -> None:
    study = _study(f"sqlite:///{tmp_path / 'db.sqlite'}")
    space = SearchSpace.from_dict(SPACE, "test")
    runs = tmp_path / "runs"
    study.sampler = make_sampler(study, 0, space=space, strategy=strategy)
    study.enqueue_trial({"attention": "eager", "micro_batch_size": 1})  # the crash comes first
    objective = Objective(study, space, ScriptRunner(runs, CRASH_JOB))
    study.optimize(objective, n_trials=8)
    ran = [p.read_text() for p in runs.glob("*/spec.json.ran")]
    crashing = [r for r in ran if '"eager"' in r and '"micro_batch_size": 1' in r]
    assert len(crashing) == 1
    trials = study.get_trials()
    first = trials[0]
    assert first.state == optuna.trial.TrialState.COMPLETE  # learned, not ignored as FAIL
    assert first.user_attrs["status"] == "failed"
    assert "crashed" in first.user_attrs["error"]
    assert "unsupported here" in first.user_attrs["stderr_tail"]
    assert first.user_attrs["constraints"]["failed"] > 0
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


# --- 3. one rank's OOM stops every rank ----------------------------------------------------------


def test_one_rank_oom_stops_the_trial(tmp_path: Path) -> None:
    spec = tiny_spec(
        {"micro_batch_size": 4, "zero_stage": 2, "reduce_bucket_size": 500_000},
        seq_len=16,
        global_batch_size=4,
        nproc=2,
    )
    spec.rank_budget_bytes = {"1": 40 * MIB}  # only rank 1 runs out
    start = time.monotonic()
    timeout = 600
    result = SubprocessRunner(tmp_path, timeout_s=timeout).run(spec, "t")
    took = time.monotonic() - start
    assert result.status == "oom", result.error + result.stderr_tail
    assert result.oom_rank == 1 and "rank 1" in result.error
    # not the trial timeout: the other rank was stopped (about 30 s on an idle 2-core machine,
    # 133 s beside another test's trials)
    assert took < timeout / 2


def test_merge_keeps_the_oom_of_a_stopped_world() -> None:
    oom = TrialResult("oom", 50, error="CPU tracker: out of memory", wall_s=2.0, oom_rank=1)
    merged = merge_ranks([oom], n_ranks=2)
    assert merged.status == "oom" and merged.oom_rank == 1 and merged.error.startswith("rank 1")


# --- 4. a trial's environment is its own ---------------------------------------------------------

CALLER = {
    "WORLD_SIZE": "8",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.255.255.1",
    "MASTER_PORT": "1",
    "TORCHELASTIC_RUN_ID": "someone-elses",
    "OMPI_COMM_WORLD_SIZE": "8",
    "PATH": os.environ.get("PATH", ""),
}


def test_trial_env_drops_the_callers_world() -> None:
    env = trial_env(CALLER, tiny_spec({}))
    assert env["PATH"] == CALLER["PATH"]
    assert not {k for k in env if k in CALLER and k != "PATH"}


def test_a_slurm_job_gets_the_trial_env_without_the_controller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sbatch exports the environment it runs with: a Slurm trial's is a local trial's, without
    an enclosing Slurm job's variables or the controller's pid (the job runs on another node),
    with the trial's allocator settings."""
    from autotune.launchers import slurm_env
    from trials.lifeline import CONTROLLER_ENV

    for key, value in {**CALLER, "SLURM_JOB_ID": "7", "SLURM_CONF": "/etc/slurm.conf"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(CONTROLLER_ENV, "1")
    spec = tiny_spec({"expandable_segments": True})
    spec.backend = "cuda"
    env = slurm_env(spec)
    assert env["PATH"] == CALLER["PATH"] and env["SLURM_CONF"] == "/etc/slurm.conf"
    assert not {k for k in env if k in CALLER and k != "PATH"}
    assert "SLURM_JOB_ID" not in env and CONTROLLER_ENV not in env
    assert "expandable_segments:True" in env["PYTORCH_CUDA_ALLOC_CONF"]


def test_trial_runs_with_a_distributed_caller_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in CALLER.items():
        monkeypatch.setenv(key, value)
    spec = tiny_spec({"micro_batch_size": 4, "zero_stage": 0}, seq_len=16, measured_steps=1)
    result = SubprocessRunner(tmp_path, timeout_s=300).run(spec, "t")
    assert result.status == "ok", result.error + result.stderr_tail


# --- 5. trial folders unique per (database, study) -----------------------------------------------


def test_same_study_name_in_two_databases_gets_two_folders(tmp_path: Path) -> None:
    a = _study(f"sqlite:///{tmp_path / 'a.db'}", "same")
    b = _study(f"sqlite:///{tmp_path / 'b.db'}", "same")
    assert workdir_for(a) != workdir_for(b)
    assert workdir_for(a) == workdir_for(optuna.load_study(study_name="same", storage=a._storage))
    first = new_trial_dir(tmp_path, "trial-0")
    again = new_trial_dir(tmp_path, "trial-0")  # a folder left by another run is never reused
    assert first != again and again.name.startswith("trial-0-")


def test_two_studies_run_concurrently_keep_their_own_measurements(tmp_path: Path) -> None:
    """Two databases, one study name, the same cwd; jobs that take turns finishing."""
    code = (
        "import sys, time; from trials.spec import TrialResult, TrialSpec\n"
        "spec = TrialSpec.load(sys.argv[1]); mb = spec.config['micro_batch_size']\n"
        "time.sleep(0.3 if spec.budget_bytes == 10**9 else 0.1)\n"
        "peak = spec.budget_bytes // 100 * mb\n"
        "open(sys.argv[2], 'w').write(TrialResult('ok', peak, 1.0, [1.0]).to_json())\n"
    )
    space = SearchSpace.from_dict(SPACE, "test")
    studies = [
        _study(f"sqlite:///{tmp_path / n}.db", "same", b) for n, b in (("a", 10**9), ("b", 10**8))
    ]

    def drive(study: optuna.Study) -> None:
        runner = ScriptRunner(tmp_path / workdir_for(study), code)
        study.sampler = make_sampler(study, 0, space=space, strategy="random")
        study.optimize(Objective(study, space, runner), n_trials=4)

    threads = [threading.Thread(target=drive, args=(s,)) for s in studies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for study, budget in zip(studies, (10**9, 10**8), strict=True):
        for t in study.get_trials():
            mb = t.user_attrs["config"]["micro_batch_size"]
            assert t.user_attrs["peak_bytes"] == budget // 100 * mb


# --- 6. no trial left RUNNING after a write error -----------------------------------------------


def test_a_full_database_fails_the_trial_with_a_reason(tmp_path: Path) -> None:
    """SQLite's own SQLITE_FULL: no page may be added once the job has run."""
    from sqlalchemy import event

    study = _study(f"sqlite:///{tmp_path / 'db.sqlite'}")
    storage = open_storage(f"sqlite:///{tmp_path / 'db.sqlite'}")
    study = optuna.load_study(study_name="s", storage=storage)
    space = SearchSpace.from_dict(SPACE, "test")
    code = (  # a long stderr tail: new pages are needed to store it
        "import sys; from trials.spec import TrialResult\n"
        "r = TrialResult('ok', 1, 1.0, [1.0], stderr_tail='x' * 200_000)\n"
        "open(sys.argv[2], 'w').write(r.to_json())\n"
    )

    class FillingRunner(ScriptRunner):
        def run(self, spec: TrialSpec, name: str) -> TrialResult:
            result = super().run(spec, name)
            engine = storage.engine
            with engine.connect() as conn:
                pages = conn.exec_driver_sql("PRAGMA page_count").scalar()

            @event.listens_for(engine, "connect")
            def full(dbapi_conn: Any, record: Any) -> None:
                dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")

            engine.dispose()
            return result

    objective = Objective(study, space, FillingRunner(tmp_path / "runs", code))
    with pytest.raises(ResultNotStored, match="full"):
        study.optimize(objective, n_trials=1)
    line = fail_running_trials(study, objective.started)
    state = study.get_trials()[0].state
    assert state == optuna.trial.TrialState.FAIL, line
    assert line == "trial 0 is marked failed", line


# --- 7. the CUDA path, as pure functions ---------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled cuda error, NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA "
        "function failed.\nLast error:\nFailed to CUDA calloc async 4096 bytes",
        "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
    ],
)
def test_oom_outside_the_allocator_is_oom(text: str) -> None:
    assert is_oom_message(text)


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "ValueError: micro_batch_size 3 does not divide global_batch_size 8",
        "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasGemmEx",
    ],
)
def test_other_errors_are_not_oom(text: str) -> None:
    assert not is_oom_message(text)


def test_card_accounting() -> None:
    gib = 2**30
    # 80 GiB card, 1 GiB held by another process at the start, 21 GiB free now: we hold 58
    assert card_bytes(80 * gib, 21 * gib, 1 * gib) == 58 * gib
    # a 24 GiB budget with a 0.5 GiB context outside the allocator: the allocator gets 23.5
    assert allocator_fraction(24 * gib, 80 * gib, gib // 2) == pytest.approx(23.5 / 80)
    assert allocator_fraction(200 * gib, 80 * gib, 0) == 1.0
    assert over_card_budget(25 * gib, 24 * gib) and over_card_budget(24 * gib, 24 * gib) is None
    assert is_oom_message(over_card_budget(25 * gib, 24 * gib) or "")


def test_alloc_conf_and_fp16_and_capped() -> None:
    assert alloc_conf_with("", True) == "expandable_segments:True"
    assert (
        alloc_conf_with("max_split_size_mb:128,expandable_segments:True", False)
        == "max_split_size_mb:128,expandable_segments:False"
    )
    env = trial_env({}, tiny_spec({"expandable_segments": True}, backend="cuda"))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trial_env({}, tiny_spec({}))
    assert measured_tokens(1024, 4, 1) == 3072
    assert scaler_skipped(65536.0, 32768.0) and not scaler_skipped(65536.0, 65536.0)
    assert capped(None, "oom", "cuda") and not capped(10, "oom", "cuda")
    assert not capped(None, "oom", "cpu")


def test_a_real_scaler_skip_is_counted() -> None:
    """torch's GradScaler on the CPU: an inf gradient skips the step and halves the scale."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(p.sum() * float("inf")).backward()
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert scaler_skipped(before, scaler.get_scale())
    assert torch.equal(p.data, torch.ones(3))  # no update: its tokens did not train


def test_expandable_segments_is_dropped_on_cpu_with_a_reason() -> None:
    space = SearchSpace.load().resolve(8, Hardware("cpu"))
    assert "expandable_segments" not in {d.name for d in space.dimensions}
    assert any(line.startswith("expandable_segments: needs a CUDA GPU") for line in space.dropped)
    gpu = SearchSpace.load().resolve(8, Hardware("cuda", (9, 0), 1))
    assert "expandable_segments" in {d.name for d in gpu.dimensions}
