"""``autotune run``: its options (every option of the command is declared here, in one
block), the plan of the study from them (``autotune.plan``), the trials, the answer."""

from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource
from rich.markup import escape

from autotune.commands.controller import climb, optimize
from autotune.commands.options import (
    FiniteFloat,
    LaunchingCommand,
    launcher_option,
    storage_option,
    timeout_option,
    trial_timeout_option,
)
from autotune.commands.output import answer, console
from autotune.estimate_backend import queue_class_bests
from autotune.estimate_cli import MAX_BATCH, MAX_SEQ_LEN
from autotune.launchers import LAUNCHERS
from autotune.plan import RunOptions, plan_study
from autotune.space import SearchSpace
from autotune.storage import open_storage
from autotune.study import DEFAULT_ALLOW, STRATEGIES, create_or_load, settings_of
from autotune.trial_cost import TIMEOUT_FLOOR_S
from autotune.units import format_size
from trials.techniques import FIDELITY_CLASSES

#: numpy's and torch's seeds are 32-bit
MAX_SEED = 2**32 - 1
#: the options of ``run`` that belong to the command, not to the plan of the study (the others
#: are fields of ``autotune.plan.RunOptions``, or the launchers')
COMMAND_OPTIONS = ("n_trials", "storage", "trial_timeout", "timeout", "strategy", "ladder", "table")


@click.command(cls=LaunchingCommand)
@click.option("--model", required=True, help="Registered model name or a path to a config.json.")
@click.option("--budget", required=True, help="Memory budget per device, e.g. 24GB, 24GiB, 300MB.")
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    default=None,
    help="Default 12 (--backend estimate: every configuration is scored and the best of each "
    "fidelity class recorded as a trial).",
)
@storage_option
@click.option("--study-name", default=None, help="Default: <model>-<budget>-<backend>.")
@click.option(
    "--space",
    "space_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Search space YAML (default: the packaged search_spaces/default.yaml).",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "cpu", "cuda", "estimate"]),
    default="auto",
    show_default=True,
    help="estimate: predictions for --gpu, chosen by auto without a GPU for models too big "
    "for CPU trials.",
)
@click.option("--gpu", default=None, help="Target GPU of --backend estimate (default: by budget).")
@click.option(
    "--loss-tolerance",
    type=FiniteFloat(min=0.0, max=10.0),
    default=0.02,
    show_default=True,
    help="Allowed relative loss regression of lossy techniques vs the reference.",
)
@click.option(
    "--allow",
    type=click.Choice(FIDELITY_CLASSES),
    default=DEFAULT_ALLOW,
    show_default=True,
    help="The widest fidelity class searched, in order exact < mixed < reduced_state < "
    "other_optimizer < adapters: `exact` searches only exact techniques, `mixed` adds 16-bit "
    "compute, `adapters` adds LoRA/QLoRA.",
)
@click.option(
    "--probe-steps",
    type=click.IntRange(min=0),
    default=None,
    help="Steps of the loss probe that judges lossy numerics on a small proxy of the model "
    "(default 200; --backend estimate: 0, no probes).",
)
@click.option(
    "--confirm-rounds",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Rounds of side-by-side re-measurement of each class's fastest configurations before "
    "a winner is named; 0: none.",
)
@click.option(
    "--probe-seeds",
    type=click.IntRange(min=2),
    default=2,
    show_default=True,
    help="Seeds per probe: their spread is the noise band shown with each verdict.",
)
@trial_timeout_option
@click.option(
    "--trial-timeout-floor",
    type=FiniteFloat(min=1.0),
    default=TIMEOUT_FLOOR_S,
    show_default=True,
    help="The least seconds a trial job gets before it is killed (its start: imports, model "
    "build), whatever its predicted steps take.",
)
@timeout_option
@click.option("--seq-len", type=click.IntRange(min=8, max=MAX_SEQ_LEN), default=None)
@click.option("--global-batch-size", type=click.IntRange(min=1, max=MAX_BATCH), default=None)
@click.option(
    "--documents",
    default=None,
    metavar="MIN:MAX",
    help="Train on variable-length documents of MIN to MAX tokens (as fine-tuning data), "
    "padded or packed (the packing dimension); default: every sequence --seq-len tokens.",
)
# the user's dataset (autotune/data_source.py, docs/guide/data.md)
@click.option(
    "--data",
    default=None,
    metavar="PATH_OR_NAME",
    help="Train on your dataset: a JSONL, Parquet or text file, a saved `datasets` folder, or a "
    "Hub dataset already in the local cache; its real lengths, padded or packed.",
)
@click.option("--data-field", default=None, help="The field of --data holding the text.")
@click.option(
    "--tokenizer",
    default=None,
    help="Tokenizer of --data: a folder or a cached Hub id (default: the --model folder's).",
)
@click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED), default=0, show_default=True)
@click.option(
    "--lr",
    type=FiniteFloat(min=0, min_open=True),
    default=None,
    help="Your learning rate: the trials and loss probes train at it (default 3e-3), and every "
    "export writes it.",
)
@click.option(
    "--strategy",
    type=click.Choice(sorted(STRATEGIES)),
    default="autotune",
    show_default=True,
    help="autotune: estimator-ordered, corrected by measurements (see autotune/strategy.py).",
)
@click.option(
    "--ladder",
    is_flag=True,
    help="Then measure the ablation ladder from the plain baseline to the winner.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1, max=1024),
    default=None,
    help="CPU: run each trial as N processes (torchrun, gloo); the budget is per process.",
)
@click.option("--table", is_flag=True, help="Print every trial's row before the answer.")
@click.option(
    "--gpus",
    type=click.IntRange(min=1, max=1024),
    default=None,
    help="CUDA: run each trial on N GPUs (torchrun, nccl); the budget is per GPU.",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1, max=1024),
    default=1,
    show_default=True,
    help="Nodes each trial spans (torchrun agents meeting through c10d rendezvous); with "
    "--gpus-per-node (CUDA, estimate) or --nproc-per-node (CPU).",
)
@click.option("--gpus-per-node", type=click.IntRange(min=1, max=1024), default=None)
@click.option("--nproc-per-node", type=click.IntRange(min=1, max=1024), default=None)
@launcher_option
@click.option(
    "--host-memory",
    default=None,
    help="Host RAM a trial may use on each machine, e.g. 128GB (default: this machine's "
    "memory; --backend estimate: the GPU's server's where its row gives one, else unlimited; "
    "--launcher slurm: unlimited; always shown).",
)
def run(**options: Any) -> None:
    """Run (or continue) a study of real training trials (or of predictions, without a GPU)."""
    ctx = click.get_current_context()
    typed = {
        name
        for name in options
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    }
    own = {key: options.pop(key) for key in COMMAND_OPTIONS}
    # --launcher and each launcher's own options go to the launcher; every other option is a
    # field of RunOptions (an option that is neither fails here, loudly)
    launching = {"launcher", *(o.name for one in LAUNCHERS.values() for o in one.click_options)}
    launcher = {key: options.pop(key) for key in launching}
    plan = plan_study(
        RunOptions(**options, launching=launcher, typed=frozenset(typed)),
        say=lambda line: console.print(f"[bold yellow]{escape(line)}[/]"),
    )
    settings, name, entry, gpu_target = plan.settings, plan.name, plan.entry, plan.gpu_target
    storage = own["storage"]
    study = create_or_load(open_storage(storage), name, settings, plan.given)
    if plan.prepared is not None:
        console.print(plan.prepared.summary(), markup=False)
    where = f"on {gpu_target.name}" if gpu_target else "here"
    for line in plan.dropped:
        console.print(f"unavailable {where}: {line}", style="dim", markup=False)
    per_class = None
    n_trials = own["n_trials"]
    if gpu_target is not None:  # every configuration scored; each class's best is a trial
        per_class, queued = queue_class_bests(study, console)
        n_trials = max(n_trials or 0, queued)
    n_trials = n_trials or 12
    console.print(
        f"study '{name}': {entry.name} ({entry.n_params / 1e6:,.1f}M params), budget "
        f"{format_size(settings.budget_bytes)}, backend {settings.backend}, "
        f"{len(study.trials)} trials so far, running {n_trials} more",
        markup=False,
    )
    optimize(
        study,
        SearchSpace.from_dict(settings_of(study).space, "study"),
        n_trials,
        own["timeout"],
        own["trial_timeout"],
        storage,
        strategy=own["strategy"],
    )
    answer(study, storage, table=own["table"], per_class=per_class)
    if own["ladder"]:
        climb(study, own["trial_timeout"], storage)
