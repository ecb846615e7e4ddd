"""The workload (model, sequence length, global batch, processes, nodes, GPU, documents) reaches
the estimators as one ``Workload``: no function of their entry points spells the bundle out in
its parameters (read from the syntax tree), and a workload over nodes is priced on them."""

from __future__ import annotations

import ast
from pathlib import Path

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GPUS
from autotune.estimator.workload import Workload
from autotune.models import MODELS

ROOT = Path(__file__).resolve().parent.parent

#: the modules whose functions take a workload (the formula libraries, states.py apart from
#: ``estimator_states`` and activations.py, take the model and a step's derived figures instead:
#: ``model_states(model_cfg, config, nproc, nodes=...)`` as DeepSpeed's own estimators do)
ENTRY_POINTS = [
    "autotune/estimator/base.py",
    "autotune/estimator/analytical.py",
    "autotune/estimator/speed.py",
    "autotune/estimator/traced.py",
    "autotune/estimator/exhaustive.py",
    "autotune/estimator/prediction_runners.py",
    "autotune/estimator/formulas.py",
    "autotune/estimate_backend.py",
    "autotune/estimator/paging.py",
    "autotune/strategy.py",
    "autotune/trial_cost.py",
]

#: parameter names of the bundle's parts (those of the model config, the data and the machines)
BUNDLE = {
    "model_config",
    "model_cfg",
    "seq_len",
    "seq",
    "global_batch_size",
    "gbs",
    "nproc",
    "n_procs",
    "world",
    "nodes",
    "documents",
    "gpu",
}


#: functions taking parts of the bundle that are no estimate: ``hardware_for`` makes the
#: search space's ``trials.hardware.Hardware`` of a GPU and its count
NOT_ESTIMATES = {"hardware_for"}


def spelled_out(source: str) -> list[str]:
    """Functions of ``source`` taking two or more parts of the bundle as parameters."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
            if len(names & BUNDLE) >= 2 and node.name not in NOT_ESTIMATES:
                found.append(f"{node.name}({', '.join(sorted(names & BUNDLE))})")
    return found


def test_the_reader_finds_a_spelled_out_bundle() -> None:
    src = "def f(model_config, config, *, seq_len, global_batch_size): ...\ndef g(gpu): ..."
    assert spelled_out(src) == ["f(global_batch_size, model_config, seq_len)"]


def test_no_entry_point_spells_the_workload_out() -> None:
    offenders = {
        path: found for path in ENTRY_POINTS if (found := spelled_out((ROOT / path).read_text()))
    }
    assert not offenders, offenders
    # the model states both estimators start from take the workload too
    states = (ROOT / "autotune/estimator/states.py").read_text()
    assert not [f for f in spelled_out(states) if f.startswith("estimator_states(")]


def test_a_workload_over_nodes_is_priced_on_their_network() -> None:
    """``nodes`` prices ZeRO-3's collectives on the nodes' network as the card spanning them
    (``GpuSpec.spanning``) does: the same figures either way, slower than one NVLink domain."""
    llama = MODELS["llama-7b"].config
    config = {"zero_stage": 3, "precision": "bf16", "micro_batch_size": 1, "optimizer": "adamw"}
    h100 = GPUS["h100"]
    kw = {"seq_len_tokens": 512, "global_batch_sequences": 16, "processes": 16}
    over_nodes = AnalyticalEstimator().estimate(Workload(llama, nodes=2, gpu=h100, **kw), config)
    spanned = AnalyticalEstimator().estimate(Workload(llama, gpu=h100.spanning(2, 8), **kw), config)
    one_node = AnalyticalEstimator().estimate(Workload(llama, gpu=h100, **kw), config)
    assert over_nodes.time_breakdown == spanned.time_breakdown
    assert over_nodes.peak_bytes == spanned.peak_bytes
    assert over_nodes.tokens_per_s < one_node.tokens_per_s
