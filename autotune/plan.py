"""The plan of a study: its settings (``StudySettings``) from the options of ``autotune run``,
every check of them one line (``UserError``), and no click. ``commands/run.py`` declares the
options and hands them here as ``RunOptions``.

A new option of ``run`` that shapes the study: a field of ``RunOptions`` (its name is the click
parameter's), its option in ``commands/run.py``, its use in ``plan_study``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from autotune.availability import Hardware
from autotune.backends import backend_named
from autotune.data_source import Prepared as PreparedData
from autotune.data_source import attach as attach_data
from autotune.errors import UserError
from autotune.estimate_backend import (
    estimate_space,
    hardware_for,
    machine_memory,
    target_gpu,
)
from autotune.estimate_cli import MAX_SEQ_LEN, banner
from autotune.estimator.gpus import GpuSpec, gpu_spec
from autotune.launchers import LAUNCHERS, launcher_attrs, launcher_of
from autotune.model_source import model_settings
from autotune.models import ModelEntry, check_seq_len, resolve_model
from autotune.space import SearchSpace
from autotune.study import DEFAULT_ALLOW, GIVEN_OPTIONS, StudySettings
from autotune.terminal import printable
from autotune.trial_cost import TIMEOUT_FLOOR_S
from autotune.units import budget_label, parse_size
from trials.data import Documents
from trials.techniques import classes_up_to

#: Real CPU trials build the model in this machine's memory; beyond this they can't run here.
MAX_CPU_TRIAL_PARAMS = 500_000_000
#: a study name is a folder name for its trial jobs (255 bytes at most) and Optuna keeps 512
MAX_STUDY_NAME = 200
#: the settings a user may give again for an existing study (``GIVEN_OPTIONS``), by the
#: ``RunOptions`` field that gives each
GIVEN_BY = {
    "loss_tolerance": "loss_tolerance",
    "seed": "seed",
    "target_gpu": "gpu",
    "user_lr": "lr",
}


@dataclass(frozen=True)
class RunOptions:
    """The options of ``autotune run`` that shape the study, as typed (the defaults are the
    command's)."""

    model: str
    budget: str
    study_name: str | None = None
    space_path: str | None = None
    backend: str = "auto"  # auto, cpu, cuda, estimate
    gpu: str | None = None
    loss_tolerance: float = 0.02
    allow: str = DEFAULT_ALLOW
    probe_steps: int | None = None
    confirm_rounds: int = 2
    trial_timeout_floor: float = TIMEOUT_FLOOR_S
    probe_seeds: int = 2
    seq_len: int | None = None
    global_batch_size: int | None = None
    documents: str | None = None
    #: the user's dataset (``autotune/data_source.py``): its path or cached name, text field,
    #: tokenizer
    data: str | None = None
    data_field: str | None = None
    tokenizer: str | None = None
    seed: int = 0
    lr: float | None = None  # the user's learning rate (None: the trials' default)
    nproc: int | None = None
    gpus: int | None = None
    nodes: int = 1
    gpus_per_node: int | None = None
    nproc_per_node: int | None = None
    host_memory: str | None = None
    #: ``--launcher`` and every launcher's own options, by parameter name, as given (None: not)
    launching: dict[str, Any] = field(default_factory=dict)
    #: the fields the user typed (not left at their defaults)
    typed: frozenset[str] = frozenset()

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass
class StudyPlan:
    """What ``run`` opens or creates, and what it says about it."""

    settings: StudySettings
    name: str  # the study's name: --study-name or the settings' default
    #: settings the user gave (``GIVEN_OPTIONS`` keys) that an existing study must match
    given: set[str]
    entry: ModelEntry
    #: the GPU of an estimate study (None: trials measure on this machine's devices)
    gpu_target: GpuSpec | None
    #: the space's choices unavailable on the hardware, a line each
    dropped: list[str]
    #: the user's dataset, tokenized (None: synthetic tokens)
    prepared: PreparedData | None = None


def plan_study(options: RunOptions, say: Callable[[str], None] = lambda line: None) -> StudyPlan:
    """The study ``options`` describe. ``say``: the banner when ``--backend auto`` turns to
    predictions (a model too big for CPU trials, no GPU), as soon as that is known."""
    o = options
    budget_bytes = parse_size(o.budget)
    if o.study_name is not None:
        check_study_name(o.study_name)
    host_limit = parse_size(o.host_memory) if o.host_memory else None
    entry = resolve_model(o.model)
    check_seq_len(o.seq_len, entry.config, entry.name)
    docs = documents_of(o.documents, o.seq_len or entry.seq_len)
    space = SearchSpace.load(o.space_path)
    given_launcher = o.launching.get("launcher")
    if given_launcher is not None and given_launcher not in LAUNCHERS:
        raise UserError(f"--launcher {printable(given_launcher)}: one of {', '.join(LAUNCHERS)}")
    chosen = LAUNCHERS[given_launcher or "local"]
    #: the launchers whose trials run on a cluster's nodes, as options to type
    remote = " or ".join(f"--launcher {one.name}" for one in LAUNCHERS.values() if one.remote)
    gpus_per_node, gpus, gpu = o.gpus_per_node, o.gpus, o.gpu
    hardware = Hardware.detect(None if o.backend in ("auto", "estimate") else o.backend)
    if backend_named(hardware.backend).cuda and not cuda_available():
        if not chosen.remote or gpu is None:
            raise UserError(
                "--backend cuda: no CUDA GPU is visible to torch here"
                + (f"; with {remote} name the nodes' GPU with --gpu" if given_launcher else "")
            )
        hardware = hardware_for(gpu_spec(gpu), gpus_per_node or gpus or 1)
    gpu_target = None
    if o.backend == "estimate" or (
        o.backend == "auto"
        and not backend_named(hardware.backend).cuda
        and entry.n_params > MAX_CPU_TRIAL_PARAMS
    ):
        gpu_target = target_gpu(gpu, budget_bytes)
        if o.backend == "auto":
            say(banner(entry.name, entry.n_params, gpu_target))
        if o.space_path is None:
            space = estimate_space()
        hardware = hardware_for(gpu_target, gpus_per_node or gpus or 1)
    elif not backend_named(hardware.backend).cuda and entry.n_params > MAX_CPU_TRIAL_PARAMS:
        raise UserError(
            f"{entry.name} has {entry.n_params / 1e9:.1f}B parameters: too big for real CPU "
            "trials on this machine; use a GPU (--backend cuda), --backend estimate, or a "
            "small model"
        )
    if (
        gpu is not None
        and gpu_target is None
        and not (backend_named(hardware.backend).cuda and chosen.remote)
    ):
        raise UserError(
            f"--gpu {printable(gpu)} names the GPU that --backend estimate predicts for (or the "
            f"Slurm nodes' GPU); these trials run on this machine's {hardware.backend.upper()}"
            ", which --gpu does not change: drop --gpu, or add --backend estimate"
        )
    nodes = o.nodes
    per_node = ranks_per_node(
        nodes, o.nproc, gpus, o.nproc_per_node, gpus_per_node, hardware, gpu_target
    )
    launcher_settings = (
        {"name": "local"}
        if gpu_target
        else launcher_attrs(
            {}, o.launching, gpus_per_node=per_node if backend_named(hardware.backend).cuda else 0
        )
    )
    if (
        gpu_target is None
        and nodes > 1
        and backend_named(hardware.backend).cuda
        and not launcher_of(launcher_settings).remote
    ):
        raise UserError(
            f"--nodes {nodes} on CUDA: nodes are the cluster's; use {remote} "
            "(the local launcher simulates nodes with CPU processes only)"
        )
    ranks = nodes * per_node
    gbs = o.global_batch_size or entry.global_batch_size
    varied = docs is not None or o.data is not None  # variable-length documents
    resolved = space.resolve(gbs, hardware, classes_up_to(o.allow), documents=varied)
    settings = StudySettings(
        model=entry.name,
        model_config=entry.config,
        budget_bytes=budget_bytes,
        budget_label=budget_label(o.budget),
        backend="estimate" if gpu_target else hardware.backend,
        target_gpu=gpu_target.key if gpu_target else "",
        seq_len=o.seq_len or entry.seq_len,
        global_batch_size=gbs,
        space=resolved.as_dict(),
        loss_tolerance=o.loss_tolerance,
        seed=o.seed,
        nproc=ranks,
        allow=o.allow,
        probe_steps=o.probe_steps if o.probe_steps is not None else (0 if gpu_target else 200),
        probe_seeds=o.probe_seeds,
        confirm_rounds=o.confirm_rounds,
        trial_timeout_floor_s=o.trial_timeout_floor,
        nodes=nodes,
        documents=docs.stored() if docs else None,
        launcher=launcher_settings,
        # default: this machine's memory; for predictions the target GPU's server's (its
        # ``Machine`` row), unlimited where that is not known; unlimited for a cluster's jobs
        # (Slurm: the nodes' memory is not this login node's: --host-memory gives it)
        host_budget_bytes=host_limit
        or (
            (gpu_target.host_memory_bytes or 0)
            if gpu_target
            else (0 if launcher_of(launcher_settings).remote else machine_memory())
        ),
        **model_settings(entry.weights, o.lr),
    )
    prepared = attach_data(settings, o.data, o.data_field, o.tokenizer, o.model)
    name = o.study_name or settings.default_study_name()
    check_study_name(name)
    given = {key for key, option in GIVEN_BY.items() if option in o.typed}
    assert given <= GIVEN_OPTIONS.keys()
    return StudyPlan(settings, name, given, entry, gpu_target, list(resolved.dropped), prepared)


def check_study_name(name: str) -> None:
    if not name.strip():
        raise UserError("--study-name is empty: give a name, or leave the option out")
    if len(name) > MAX_STUDY_NAME:
        raise UserError(
            f"--study-name is {len(name)} characters long; use at most {MAX_STUDY_NAME}"
        )
    if not name.isprintable():
        raise UserError(
            f"--study-name {printable(name)!r} holds control characters (a newline?); "
            "use printable characters"
        )


def documents_of(text: str | None, seq_len: int) -> Documents | None:
    """``--documents MIN:MAX``, within the sequence length."""
    if text is None:
        return None
    try:
        docs = Documents.parse(text)
    except ValueError as exc:
        raise UserError(f"--documents: {exc}") from None
    if docs.longest > MAX_SEQ_LEN:
        raise UserError(f"--documents {printable(text)}: documents of more than "
                        f"{MAX_SEQ_LEN:,} tokens (docs/guide/limits.md)")  # fmt: skip
    if docs.shortest > seq_len:
        raise UserError(
            f"--documents {text}: the shortest document is longer than the sequence ({seq_len})"
        )
    return docs


def ranks_per_node(
    nodes: int,
    nproc: int | None,
    gpus: int | None,
    nproc_per_node: int | None,
    gpus_per_node: int | None,
    hardware: Hardware,
    gpu_target: Any,
) -> int:
    """Ranks on each node: --gpus-per-node (CUDA, estimate) or --nproc-per-node (CPU); with one
    node, --gpus N / --nproc N say the same."""
    for one, per in (("--gpus", gpus), ("--nproc", nproc)):
        if per is not None and nodes > 1:
            raise UserError(f"{one} is for one node; with --nodes {nodes} use {one}-per-node")
    if gpu_target is not None:  # the estimate backend: GPUs of the target machine
        if nproc_per_node is not None or nproc is not None:
            raise UserError("--nproc/--nproc-per-node are for CPU trials; the estimate backend "
                            "plans GPUs: use --gpus-per-node")  # fmt: skip
        return gpus_per_node or gpus or 1
    if gpus_per_node is not None and not backend_named(hardware.backend).cuda:
        raise UserError("--gpus-per-node needs the cuda backend; on the CPU use --nproc-per-node")
    if nproc_per_node is not None and backend_named(hardware.backend).cuda:
        raise UserError("--nproc-per-node is for CPU trials; on CUDA use --gpus-per-node")
    per = gpus_per_node or nproc_per_node
    if nodes > 1 and per is None:
        raise UserError(f"--nodes {nodes}: say how many ranks each node runs with "
                        "--gpus-per-node G (CUDA) or --nproc-per-node P (CPU)")  # fmt: skip
    if per is not None and (gpus is not None or nproc is not None):
        raise UserError("give either --gpus/--nproc or --nodes with --gpus-per-node/"
                        "--nproc-per-node, not both")  # fmt: skip
    if per is not None:
        return per
    return _ranks(nproc, gpus, hardware)


def _ranks(nproc: int | None, gpus: int | None, hardware: Hardware) -> int:
    """Processes per trial: --gpus N on CUDA, --nproc N on the CPU."""
    if gpus is not None and not backend_named(hardware.backend).cuda:
        raise UserError("--gpus needs the cuda backend; on the CPU use --nproc N")
    if nproc is not None and backend_named(hardware.backend).cuda:
        raise UserError("--nproc is for CPU trials; on CUDA use --gpus N")
    if gpus is not None and gpus > hardware.gpu_count:
        raise UserError(f"--gpus {gpus}: only {hardware.gpu_count} CUDA GPU(s) visible here")
    return gpus or nproc or 1


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
