"""The plan of a study (``autotune.plan.plan_study``) called without click: the settings of a
few option sets, written out by hand, and bad ones as the one line they raise."""

from __future__ import annotations

import os

import pytest

from autotune.errors import UserError
from autotune.models import MODELS
from autotune.plan import RunOptions, plan_study
from tests.conftest import SMALL_SPACE

TINY = {"model": "tiny-llama", "budget": "300MB", "backend": "cpu", "space_path": str(SMALL_SPACE),
        "seq_len": 64, "global_batch_size": 8}  # fmt: skip
#: the dimensions of tests/data/small_space.yaml, as that file lists them
SMALL_DIMENSIONS = {
    "gradient_checkpointing": {"choices": ["off", "full"]},
    "precision": {"choices": ["fp32", "bf16"]},
    "attention": {"choices": ["sdpa"]},
    "optimizer": {"choices": ["adamw"]},
    "micro_batch_size": {"choices": [1, 8]},
}


def test_a_cpu_study_of_tiny_llama() -> None:
    plan = plan_study(RunOptions(**TINY))
    s = plan.settings
    assert (s.model, s.model_config) == ("tiny-llama", MODELS["tiny-llama"].config)
    assert (s.budget_bytes, s.budget_label, s.backend, s.target_gpu) == (
        300_000_000, "300MB", "cpu", "")  # fmt: skip
    assert (s.seq_len, s.global_batch_size, s.nproc, s.nodes) == (64, 8, 1, 1)
    assert s.space["dimensions"] == SMALL_DIMENSIONS
    assert s.space["reference"] == {"gradient_checkpointing": "full", "precision": "fp32",
                                    "micro_batch_size": 1}  # fmt: skip
    # the command's defaults: probes of 200 steps on 2 seeds, 2 rounds of finalists, seed 0
    assert (s.probe_steps, s.probe_seeds, s.confirm_rounds, s.seed, s.loss_tolerance) == (
        200, 2, 2, 0, 0.02)  # fmt: skip
    assert (s.allow, s.documents, s.launcher) == ("other_optimizer", None, {"name": "local"})
    # a local study's host budget: this machine's physical memory
    assert s.host_budget_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (plan.name, plan.given, plan.gpu_target, plan.dropped) == (
        "tiny-llama-300MB-cpu", set(), None, [])  # fmt: skip


def test_nodes_documents_and_the_options_typed() -> None:
    plan = plan_study(RunOptions(
        **TINY, nodes=2, nproc_per_node=2, documents="16:48", host_memory="2GB", seed=7,
        study_name="mine", typed=frozenset({"seed", "nodes", "study_name"})))  # fmt: skip
    s = plan.settings
    assert (s.nproc, s.nodes, s.documents, s.host_budget_bytes, s.seed) == (
        4, 2, [16, 48], 2 * 10**9, 7)  # fmt: skip
    assert s.default_study_name() == "tiny-llama-300MB-cpu-2x2-docs16-48"
    # a study given by name; of the options typed only --seed must match an existing study's
    assert (plan.name, plan.given) == ("mine", {"seed"})


def test_a_model_too_big_for_cpu_trials_is_predicted_for_the_budgets_gpu() -> None:
    said: list[str] = []
    plan = plan_study(
        RunOptions(model="llama-7b", budget="24GB", typed=frozenset({"gpu", "seed"})),
        say=said.append,
    )
    s = plan.settings
    # 24 GB: the 24 GiB RTX 4090 (estimator/gpus.py's row); predictions: no probes, no host
    # limit, the estimate space, the model's own sequence length and batch
    assert (s.backend, s.target_gpu, s.probe_steps, s.host_budget_bytes) == (
        "estimate", "rtx4090", 0, 0)  # fmt: skip
    assert (s.seq_len, s.global_batch_size, s.nproc) == (2048, 32, 1)
    assert plan.name == "llama-7b-24GB-estimate"
    assert plan.given == {"target_gpu", "seed"}
    assert plan.gpu_target is not None and plan.gpu_target.key == "rtx4090"
    assert len(said) == 1 and said[0].startswith("no GPU here and llama-7b (6.7B params)")


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"nodes": 2, "nproc": 2}, "--nproc is for one node; with --nodes 2 use --nproc-per-node"),
        (
            {"nodes": 2},
            "--nodes 2: say how many ranks each node runs with --gpus-per-node G "
            "(CUDA) or --nproc-per-node P (CPU)",
        ),
        (
            {"gpus_per_node": 1},
            "--gpus-per-node needs the cuda backend; on the CPU use --nproc-per-node",
        ),
        ({"gpus": 2}, "--gpus needs the cuda backend; on the CPU use --nproc N"),
        (
            {"documents": "100:200"},
            "--documents 100:200: the shortest document is longer than the sequence (64)",
        ),
        ({"study_name": " "}, "--study-name is empty: give a name, or leave the option out"),
        (
            {"launching": {"partition": "gpu"}},
            "--partition is a Slurm option: add --launcher slurm",
        ),
        (
            {"gpu": "h100"},
            "--gpu h100 names the GPU that --backend estimate predicts for (or the "
            "Slurm nodes' GPU); these trials run on this machine's CPU, which --gpu"
            " does not change: drop --gpu, or add --backend estimate",
        ),
        (
            {"model": "llama-7b", "budget": "24GB"},
            "llama-7b has 6.7B parameters: too big for real CPU trials on this machine; use a GPU "
            "(--backend cuda), --backend estimate, or a small model",
        ),
    ],
)
def test_bad_options_raise_one_line(options: dict[str, object], line: str) -> None:
    with pytest.raises(UserError) as raised:
        plan_study(RunOptions(**{**TINY, **options}))  # type: ignore[arg-type]
    assert str(raised.value) == line


def test_run_options_default_as_the_command_does() -> None:
    """Every option of ``run`` is a field of ``RunOptions``, one of the command's own or
    ``--launcher``, and each field's default is the option's (a plan made without click plans
    what the command would)."""
    from dataclasses import MISSING, fields

    from autotune.cli import run
    from autotune.commands.run import COMMAND_OPTIONS

    defaults = {f.name: f.default for f in fields(RunOptions) if f.default is not MISSING}
    checked = 0
    for param in run.params:
        assert param.name in RunOptions.names() | set(COMMAND_OPTIONS) | {"launcher"}, param.name
        if param.name in defaults:
            assert param.default == defaults[param.name], param.name
            checked += 1
    assert checked == len(defaults) - 1  # all but typed, which no option gives


def test_an_estimate_study_takes_the_target_servers_host_memory() -> None:
    """The DGX H100's system memory, 2 TB (NVIDIA's DGX H100 datasheet; 2 TiB of DIMMs), is the
    host budget of an H100 estimate study by default; --host-memory replaces it."""
    h100 = {"model": "llama-7b", "budget": "80GB", "backend": "estimate", "gpu": "h100"}
    assert plan_study(RunOptions(**h100)).settings.host_budget_bytes == 2 * 2**40
    given = plan_study(RunOptions(**h100, host_memory="512GB")).settings
    assert given.host_budget_bytes == 512 * 10**9
