"""Launchers: where and how the ranks of one trial start, one small class each.

* ``local`` (``autotune.runner.SubprocessRunner``): this machine. One process; several ranks
  through ``torchrun --standalone``; or ``--nodes N``: N torchrun agents that meet through
  torchrun's c10d rendezvous on 127.0.0.1 (``autotune.agents``), exactly as the agents of N real
  nodes meet on the first node's address.
* ``slurm`` (``SlurmRunner``): each trial is an ``sbatch`` job of the cluster's own scheduler (no
  ssh, no pdsh, no hostfile). Inside the job, ``srun --kill-on-bad-exit`` starts one torchrun
  agent per allocated node, rendezvousing (c10d) on the job's first node; a rank that runs out of
  memory exits with an error, its agent stops its node, and srun stops every other node.

Slurm trials outlive their controller. The job id is stored on the trial (user attr
``slurm_job_id``), and the controller collecting a job marks the trial with itself
(``slurm_watcher``: host, pid, time, refreshed while it waits). A controller that starts on the
study (``run``, ``resume``, ``worker``) adopts every RUNNING trial with a job whose watcher is
gone (same host: that process is dead; another host: not refreshed for three heartbeats), keeps
its Optuna heartbeat alive and collects the job's result into the same trial. A job that was
cancelled, pre-empted, hit its time limit or lost its node is a failed trial with that reason.
Results travel through the trial folder, which must be on a file system the nodes share (as
home and project folders are on clusters).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.agents import torchrun
from autotune.errors import UserError
from autotune.runner import (
    Adoption,
    SubprocessRunner,
    TrialAttrs,
    TrialRunner,
    merge_ranks,
    new_trial_dir,
    trial_env,
)
from autotune.terminal import printable
from trials.lifeline import CONTROLLER_ENV, started_at
from trials.spec import TrialResult, TrialSpec, rank_result_path

SLURM_JOB_ATTR = "slurm_job_id"
#: the trial's own folder under the study's work folder (made fresh for its job)
FOLDER_ATTR = "slurm_folder"
WATCHER_ATTR = "slurm_watcher"
#: Slurm job states after which the job runs no more (``squeue``/``scontrol`` names)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "PREEMPTED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
#: what a final state means, for the failed trial's reason
STATE_REASONS = {
    "CANCELLED": "cancelled (scancel, or an administrator) before it finished",
    "PREEMPTED": "pre-empted by the scheduler for another job",
    "TIMEOUT": "stopped at its Slurm time limit",
    "NODE_FAIL": "lost a node",
    "OUT_OF_MEMORY": "ran out of host memory (Slurm's memory limit)",
    "BOOT_FAIL": "could not boot its node",
    "DEADLINE": "missed its deadline",
    "FAILED": "failed",
}
#: seconds after which a job unknown to Slurm (purged: no accounting database) without a complete
#: result is given up as lost
LOST_AFTER_S = 60.0
#: sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
SLURM_TIME = r"[0-9]{1,7}(:[0-9]{1,2}){0,2}|[0-9]{1,5}-[0-9]{1,2}(:[0-9]{1,2}){0,2}"
#: a partition or account name (partitions: a comma-separated list), as slurm.conf allows them
SLURM_NAME = r"[A-Za-z0-9_.+-]{1,64}(,[A-Za-z0-9_.+-]{1,64}){0,31}"


@dataclass(frozen=True)
class SlurmOptions:
    """``sbatch`` options of every trial job (what users set in their own batch scripts)."""

    partition: str = ""
    time_limit: str = ""  # sbatch --time (minutes or [D-]HH:MM:SS); default: --trial-timeout
    account: str = ""
    gpus_per_node: int = 0  # --gpus-per-node (CUDA trials)
    cpus_per_task: int = 0  # per node's agent; default: one per rank on CPU trials
    extra: tuple[str, ...] = ()  # more sbatch options, verbatim (--qos=high, --constraint=a100)
    in_flight: int = 4  # jobs submitted at once
    poll_s: float = 5.0  # seconds between looks at the queue

    def to_attrs(self) -> dict[str, Any]:
        return {"name": "slurm", **asdict(self), "extra": list(self.extra)}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> SlurmOptions:
        """The options stored with a study, checked again as when they were given: another
        tool (or an older autotune) may have written anything into the shared storage."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in attrs.items() if k in known}
        extra = kw.get("extra", ())
        if not isinstance(extra, list | tuple):
            raise UserError(f"the study's stored Slurm options: extra is {printable(repr(extra))}"
                            ", not a list of sbatch options")  # fmt: skip
        kw["extra"] = tuple(extra)
        options = cls(**kw)
        options.check("the study's stored Slurm option ")
        return options

    def check(self, where: str = "") -> None:
        """Every value as the job script may hold it: ``#SBATCH`` lines of printable text (a
        newline would end the line and run the rest in the job), options that are options,
        names as Slurm's own clients accept them, numbers in range."""
        texts = {"partition": self.partition, "account": self.account,
                 "time_limit": self.time_limit}  # fmt: skip
        flags = {"partition": "--partition", "account": "--account", "time_limit": "--slurm-time",
                 "extra": "--sbatch-option", "in_flight": "--in-flight"}  # fmt: skip

        def name(key: str) -> str:
            return f"{where}{key}" if where else flags.get(key, key)

        for key, value in texts.items():
            if not isinstance(value, str):
                raise UserError(f"{name(key)} is {printable(repr(value))}, not text")
        for key in ("partition", "account"):
            value = texts[key]
            if value and not re.fullmatch(SLURM_NAME, value):
                raise UserError(
                    f"{name(key)} {printable(repr(value))}: not a Slurm {key} name (letters, "
                    "digits, '_', '-', '.'; several partitions separated by ',')"
                )
        if self.time_limit and not re.fullmatch(SLURM_TIME, self.time_limit):
            raise UserError(f"{name('time_limit')} {printable(repr(self.time_limit))}: use "
                            "minutes or [D-]HH:MM:SS, as sbatch does")  # fmt: skip
        for opt in self.extra:
            if not isinstance(opt, str) or not opt.startswith("-") or not opt.isprintable():
                raise UserError(
                    f"{name('extra')} {printable(repr(opt))}: give one sbatch option of "
                    "printable text, e.g. --qos=high (no newline: it would end the #SBATCH line)"
                )
        for key in ("gpus_per_node", "cpus_per_task", "in_flight"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1024:
                raise UserError(f"{name(key)} is {printable(repr(value))}: a count 0..1024")
        if self.in_flight < 1:
            raise UserError(f"{name('in_flight')} is {self.in_flight}: at least 1")
        poll = self.poll_s
        if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 3600:
            raise UserError(f"{name('poll_s')} is {printable(repr(poll))}: seconds in (0, 3600]")

    def sbatch_options(self, spec: TrialSpec, timeout_s: float) -> list[str]:
        per_node = spec.nproc // max(1, spec.nodes)
        cpus = self.cpus_per_task or (per_node if spec.backend == "cpu" else 0)
        opts = [f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
        opts.append(f"--time={self.time_limit or max(1, math.ceil(timeout_s / 60))}")
        if cpus:
            opts.append(f"--cpus-per-task={cpus}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.partition:
            opts.append(f"--partition={self.partition}")
        if self.account:
            opts.append(f"--account={self.account}")
        return [*opts, *self.extra]


def slurm_env(spec: TrialSpec | None = None) -> dict[str, str]:
    """The environment Slurm commands run with, and (sbatch exports it) a trial job's: a local
    trial's (``runner.trial_env``: no enclosing torchrun's or Slurm job's layout, no storage URL,
    the trial's allocator settings) without the controller's pid, whose lifeline would end the
    job at once on another node."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env = trial_env(base, spec)
    env.pop(CONTROLLER_ENV, None)
    return env


def _slurm(
    *args: str, check: bool = True, spec: TrialSpec | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, env=slurm_env(spec), check=check, timeout=60
    )


def check_slurm(options: SlurmOptions) -> None:
    """One clear line now, rather than one failed trial per submission."""
    for tool in ("sbatch", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            raise UserError(f"--launcher slurm: `{tool}` is not on PATH (no Slurm client here)")
    probe = _slurm("sbatch", "--test-only", *options.sbatch_options(TrialSpec({}, {}, 8, 1), 60),
                   "--wrap", "true", check=False)  # fmt: skip
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.splitlines() if ln.strip()]
        reason = lines[-1].strip() if lines else f"exit code {probe.returncode}"
        raise UserError(f"--launcher slurm: sbatch refuses these options: {reason}")


@dataclass
class JobState:
    state: str  # PENDING, RUNNING, COMPLETED, CANCELLED, ... ("" when Slurm no longer knows it)
    reason: str = ""
    exit_code: str = ""

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def job_state(job_id: str) -> JobState:
    """The job as ``scontrol show job`` reports it (finished jobs stay ``MinJobAge``)."""
    out = _slurm("scontrol", "show", "job", "--oneliner", job_id, check=False)
    if out.returncode != 0:
        return JobState("")
    pairs = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", out.stdout)}
    state = pairs.get("JobState", "")
    return JobState(state, pairs.get("Reason", ""), pairs.get("ExitCode", ""))


def cancel(job_id: str) -> None:
    _slurm("scancel", job_id, check=False)


#: the only words of the exec line the job's shell expands: the rendezvous endpoint (the job's
#: first node) and id, known only inside the job; every other word is quoted
JOB_EXPANDED = frozenset({'--rdzv-endpoint="$head:$port"', '--rdzv-id="$SLURM_JOB_ID"'})


def _quote(arg: str) -> str:
    return arg if arg in JOB_EXPANDED else shlex.quote(arg)


def _sbatch_line(option: str) -> str:
    """One ``#SBATCH`` line; sbatch reads up to the end of the line and unquotes nothing
    further, so a newline or other control character (a path, a name) is refused."""
    if not option.isprintable():
        raise UserError(
            f"cannot write the Slurm job script: the sbatch option {printable(option)!r} holds "
            "control characters (a newline would end its #SBATCH line)"
        )
    return f"#SBATCH {shlex.quote(option)}"


def batch_script(
    spec: TrialSpec,
    options: SlurmOptions,
    timeout_s: float,
    job_cmd: list[str],
    log: Path,
    job_name: str,
) -> str:
    """The sbatch script of one trial: srun starts one torchrun agent per node."""
    python, module_args = job_cmd[0], job_cmd[2:]  # job_cmd: python -m trials.job SPEC RESULT
    per_node = spec.nproc // max(1, spec.nodes)
    if spec.nodes > 1:
        cmd = torchrun(python, spec.nodes, per_node, '"$head:$port"', '"$SLURM_JOB_ID"',
                       module_args)  # fmt: skip
    elif spec.nproc > 1:
        cmd = [python, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={per_node}", "-m", *module_args]  # fmt: skip
    else:
        cmd = job_cmd
    sbatch = [f"--job-name={job_name}", f"--output={log}", f"--chdir={Path.cwd()}",
              *options.sbatch_options(spec, timeout_s)]  # fmt: skip
    cpus = next((o.split("=", 1)[1] for o in sbatch if o.startswith("--cpus-per-task=")), "")
    srun = ["srun", "--kill-on-bad-exit=1", f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
    if cpus:  # srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 and later)
        srun.append(f"--cpus-per-task={cpus}")
    lines = [
        "#!/bin/bash",
        *[_sbatch_line(o) for o in sbatch],
        "# written by autotune: one trial; srun starts one torchrun agent per node",
        "export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        "exec " + " ".join(_quote(a) for a in [*srun, *cmd]),
    ]
    return "\n".join(lines) + "\n"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return ""


def watcher() -> dict[str, Any]:
    """This controller, as recorded on the trials whose jobs it collects."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": started_at(pid),
            "at": time.time()}  # fmt: skip


def watched(attrs: dict[str, Any], grace_s: float) -> bool:
    """Whether a live controller still collects this trial's job."""
    w = attrs.get(WATCHER_ATTR)
    if not isinstance(w, dict):
        return False
    if w.get("host") == socket.gethostname():
        return w.get("pid") != os.getpid() and started_at(int(w["pid"])) == w.get("started")
    return time.time() - float(w.get("at", 0)) < grace_s


class SlurmRunner(TrialRunner):
    """Each trial an sbatch job; waits for it (many at once from Optuna's ``n_jobs`` threads)."""

    def __init__(
        self,
        workdir: Path,
        options: SlurmOptions,
        timeout_s: float = 600.0,
        python: str = sys.executable,
    ) -> None:
        self.workdir = Path(workdir).absolute()
        self.options = options
        self.timeout_s = timeout_s
        self.python = python
        #: set on Ctrl-C/SIGTERM: every waiting thread cancels its job and stops
        self.stopping: threading.Event = threading.Event()

    def adopt(
        self,
        study: Any,
        storage: Callable[[], Any],
        objective: Callable[[], Callable[[Any], Any]],
        crashed: type[Exception],
    ) -> Adoption:
        adoption = adopt(study, storage(), objective(), crashed)
        adoption.why = "its Slurm job is still known to the cluster"
        return adoption

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        # a job of no trial (a loss probe, a finalist's re-measurement) is never collected after
        # a restart, so it may take a folder of its own: two controllers never share one
        return self._run(None, spec, new_trial_dir(self.workdir, name).name)

    def run_for(self, trial: TrialAttrs, spec: TrialSpec, name: str) -> TrialResult:
        # the folder a trial's job writes into is made fresh here (never one already there: a
        # link planted at trial-N would send the job's files elsewhere) and kept on the trial,
        # where a controller collecting the job after a restart finds it
        folder = trial.user_attrs.get(FOLDER_ATTR, name)
        if trial.user_attrs.get(SLURM_JOB_ATTR):  # a job submitted before: collect it
            if not isinstance(folder, str) or not re.fullmatch(
                re.escape(name) + r"(-[A-Za-z0-9_]+)?", folder
            ):
                raise UserError(f"trial folder {printable(repr(folder))} stored on the trial is "
                                "not one autotune made")  # fmt: skip
            return self._run(trial, spec, folder)
        folder = new_trial_dir(self.workdir, name).name
        trial.set_user_attr(FOLDER_ATTR, folder)
        return self._run(trial, spec, folder)

    def _paths(self, name: str) -> tuple[Path, Path, Path]:
        trial_dir = self.workdir / name
        return trial_dir, trial_dir / "spec.json", trial_dir / "result.json"

    def submit(self, spec: TrialSpec, name: str) -> str:
        """Submit the job of a trial whose folder ``new_trial_dir`` made."""
        trial_dir, spec_path, result_path = self._paths(name)
        for rank in range(spec.nproc):
            rank_result_path(result_path, rank, spec.nproc).unlink(missing_ok=True)
        spec_path.write_text(spec.to_json())
        job_cmd = [self.python, "-m", "trials.job", str(spec_path), str(result_path)]
        job_name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"autotune-{self.workdir.name}-{name}")
        script = trial_dir / "job.sbatch"
        limit = spec.timeout_s or self.timeout_s  # the trial's own (autotune.trial_cost)
        script.write_text(batch_script(spec, self.options, limit, job_cmd,
                                       trial_dir / "slurm-%j.log", job_name))  # fmt: skip
        out = _slurm("sbatch", "--parsable", str(script), check=False, spec=spec)
        if out.returncode != 0:
            raise SubmitError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "")
        return out.stdout.strip().split(";")[0]

    def _run(self, trial: TrialAttrs | None, spec: TrialSpec, name: str) -> TrialResult:
        start = time.perf_counter()
        job_id = str(trial.user_attrs.get(SLURM_JOB_ATTR, "")) if trial is not None else ""
        if not job_id:
            try:
                job_id = self.submit(spec, name)
            except SubmitError as exc:
                return TrialResult(
                    status="failed", error=f"sbatch refused the trial: {exc}", transient=True
                )
            if trial is not None:
                trial.set_user_attr(SLURM_JOB_ATTR, job_id)
        state = self.wait(job_id, trial, spec, name)
        result = self.collect(job_id, state, spec, name)
        result.wall_s = result.wall_s or time.perf_counter() - start
        return result

    def _complete(self, spec: TrialSpec, name: str) -> bool:
        result_path = self._paths(name)[2]
        return all(
            rank_result_path(result_path, r, spec.nproc).is_file() for r in range(spec.nproc)
        )

    def wait(self, job_id: str, trial: TrialAttrs | None, spec: TrialSpec, name: str) -> JobState:
        unknown_since: float | None = None
        while True:
            if trial is not None:
                trial.set_user_attr(WATCHER_ATTR, watcher())
            state = job_state(job_id)
            if state.final:
                return state
            if not state.state:  # purged from slurmctld's memory (or slurmctld unreachable)
                if self._complete(spec, name):
                    return JobState("COMPLETED")
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > LOST_AFTER_S:
                    return state
            else:
                unknown_since = None
            if self.stopping.wait(self.options.poll_s):
                cancel(job_id)
                raise KeyboardInterrupt

    def collect(self, job_id: str, state: JobState, spec: TrialSpec, name: str) -> TrialResult:
        trial_dir, _, result_path = self._paths(name)
        log = trial_dir / f"slurm-{job_id}.log"
        paths = [rank_result_path(result_path, r, spec.nproc) for r in range(spec.nproc)]
        present = [TrialResult.load(p) for p in paths if p.is_file()]
        if len(present) == spec.nproc:
            result = merge_ranks(present, nodes=spec.nodes)
            if result.status == "failed":
                result.stderr_tail = _tail(log)
            return result
        if any(r.status != "ok" for r in present):
            # one rank ran out of memory (or failed) and srun stopped the others: its result,
            # as the local runner keeps it (runner.SubprocessRunner.run)
            result = merge_ranks(present, n_ranks=spec.nproc, nodes=spec.nodes)
            result.stderr_tail = _tail(log)
            return result
        if not state.state:
            error = f"Slurm job {job_id} vanished without a result (purged, or slurmctld lost it)"
        else:
            why = STATE_REASONS.get(state.state, state.state.lower())
            if state.state in ("FAILED", "COMPLETED"):
                why = f"ended with exit code {state.exit_code} before every rank wrote a result"
            error = f"Slurm job {job_id} {state.state}: {why}"
            if state.reason and state.reason != "None":
                error += f" ({state.reason})"
        # the job's own exit is the configuration's doing; the scheduler's verdicts are not
        transient = state.state not in ("FAILED", "COMPLETED", "OUT_OF_MEMORY")
        return TrialResult(
            status="failed", error=error, stderr_tail=_tail(log), transient=transient
        )


class SubmitError(Exception):
    """sbatch refused a job."""


# --- a restarted controller collects the jobs its predecessor left ---------------------------


def orphans(study: optuna.Study, grace_s: float) -> list[FrozenTrial]:
    """RUNNING trials with a Slurm job that no live controller collects."""
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if t.user_attrs.get(SLURM_JOB_ATTR) and not watched(t.user_attrs, grace_s)
    ]


def adopt(
    study: optuna.Study,
    storage: RDBStorage,
    objective: Any,
    crashed: type[Exception],
) -> Adoption:
    """Collect every orphaned Slurm trial of ``study`` in a thread of its own: its heartbeat
    kept alive, the job waited for, the result recorded into the same trial as ``objective``
    records any (``crashed``: the objective's exception for a failed trial)."""
    interval = storage.get_heartbeat_interval() or 10
    adoption = Adoption()
    study_id = storage.get_study_id_from_name(study.study_name)
    for frozen in orphans(study, grace_s=3 * interval):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, frozen.number)
        storage.record_heartbeat(trial_id)  # before anyone's stale-trial sweep fails it
        trial = optuna.Trial(study, trial_id)
        trial.set_user_attr(WATCHER_ATTR, watcher())

        def collect(trial: optuna.Trial = trial, trial_id: int = trial_id) -> None:
            done = threading.Event()

            def beat() -> None:
                while not done.wait(interval):
                    storage.record_heartbeat(trial_id)

            threading.Thread(target=beat, daemon=True).start()
            try:
                values = objective(trial)
            except crashed:
                study.tell(trial, state=TrialState.FAIL)
            except BaseException:
                with contextlib.suppress(Exception):
                    study.tell(trial, state=TrialState.FAIL)
                raise
            else:
                study.tell(trial, values)
            finally:
                done.set()

        thread = threading.Thread(target=collect, name=f"slurm-trial-{frozen.number}")
        thread.start()
        adoption.threads.append(thread)
        adoption.numbers.append(frozen.number)
    return adoption


# --- launchers as the commands know them --------------------------------------------------------


class Launcher(ABC):
    """A way trials start. The commands that run trials (``run``, ``resume``, ``worker``) know
    launchers only through this class and ``LAUNCHERS``: ``--launcher NAME`` picks one, its own
    ``options`` are options of those commands, ``settings`` turns them into the attrs stored
    with the study, ``runner`` makes the ``TrialRunner`` of those attrs (whose hooks stop and
    adopt its jobs). A new launcher is a subclass given to ``register_launcher``."""

    #: ``--launcher NAME``
    name: ClassVar[str]
    #: its name in a line: "--partition is a Slurm option"
    label: ClassVar[str]
    #: what it does, in ``--launcher``'s help
    help: ClassVar[str]
    #: its trials run on other machines (a cluster's nodes): this machine needs no GPU of the
    #: study's, ``--gpu`` names theirs, their nodes are real ones and their memory is not this
    #: machine's (the host budget is unlimited unless given)
    remote: ClassVar[bool] = False
    #: its jobs outlive a stopped controller: ``resume`` collects them even with ``--trials 0``
    outlives_controller: ClassVar[bool] = False

    def options(self) -> list[Any]:
        """Its own click options (``click.Option``), whose values ``settings`` receives by
        parameter name; given without ``--launcher NAME`` they are refused as one line."""
        return []

    @functools.cached_property
    def click_options(self) -> list[Any]:
        return self.options()

    def settings(
        self, stored: dict[str, Any] | None, given: dict[str, Any], gpus_per_node: int
    ) -> dict[str, Any]:
        """The attrs stored with the study (``{"name": NAME, ...}``): ``stored`` (this
        launcher's attrs stored with the study, or None) changed by its options ``given`` (None
        where not given); ``gpus_per_node``: the CUDA GPUs each node of a trial uses (0: CPU)."""
        return {"name": self.name}

    @abstractmethod
    def runner(self, attrs: dict[str, Any], workdir: Path, timeout_s: float) -> TrialRunner:
        """The runner of the trials of a study with these stored attrs."""

    def concurrency(self, attrs: dict[str, Any]) -> int:
        """Trials at once (local trials: one at a time, they share the devices)."""
        return 1


class LocalLauncher(Launcher):
    name = "local"
    label = "local"
    help = "trials on this machine (default)."

    def runner(self, attrs: dict[str, Any], workdir: Path, timeout_s: float) -> TrialRunner:
        return SubprocessRunner(workdir, timeout_s=timeout_s)


class SlurmLauncher(Launcher):
    name = "slurm"
    label = "Slurm"
    help = "each trial an sbatch job; queued and running jobs survive a restart of this command."
    remote = True
    outlives_controller = True

    def options(self) -> list[Any]:
        import click

        return [
            click.Option(["--partition"], default=None, help="slurm: the partition (sbatch -p)."),
            click.Option(
                ["--account"], default=None, help="slurm: the account to charge (sbatch -A)."
            ),
            click.Option(
                ["--slurm-time"],
                default=None,
                help="slurm: each job's time limit (sbatch --time: minutes or [D-]HH:MM:SS); "
                "default: --trial-timeout.",
            ),
            click.Option(
                ["--in-flight"],
                type=click.IntRange(min=1, max=1024),
                default=None,
                help="slurm: trials submitted at once (default 4).",
            ),
            click.Option(
                ["--sbatch-option", "sbatch_options"],
                multiple=True,
                help="slurm: one more sbatch option, verbatim (e.g. --qos=high); repeatable.",
            ),
        ]

    def settings(
        self, stored: dict[str, Any] | None, given: dict[str, Any], gpus_per_node: int
    ) -> dict[str, Any]:
        base = SlurmOptions.from_attrs(stored) if stored else SlurmOptions()
        changes: dict[str, Any] = {
            "partition": given.get("partition"),
            "account": given.get("account"),
            "time_limit": given.get("slurm_time"),
            "in_flight": given.get("in_flight"),
            "extra": tuple(given.get("sbatch_options") or ()) or None,
            "gpus_per_node": gpus_per_node or None,
        }
        options = SlurmOptions(**{**asdict(base), **{k: v for k, v in changes.items() if v}})
        if os.environ.get(POLL_ENV):
            options = SlurmOptions(**{**asdict(options), "poll_s": float(os.environ[POLL_ENV])})
        options.check()
        check_slurm(options)
        return options.to_attrs()

    def runner(self, attrs: dict[str, Any], workdir: Path, timeout_s: float) -> TrialRunner:
        return SlurmRunner(workdir, SlurmOptions.from_attrs(attrs), timeout_s=timeout_s)

    def concurrency(self, attrs: dict[str, Any]) -> int:
        return int(attrs.get("in_flight", 4))


#: the launchers by name, in ``--launcher``'s order
LAUNCHERS: dict[str, Launcher] = {}


def register_launcher(launcher: Launcher) -> Launcher:
    """Add ``launcher`` to ``--launcher``'s choices and its options to the commands'."""
    taken = {flag for other in LAUNCHERS.values() for o in other.click_options for flag in o.opts}
    names = {o.name for other in LAUNCHERS.values() for o in other.click_options}
    for option in launcher.click_options:
        if taken & set(option.opts) or option.name in names | {"launcher"}:
            raise ValueError(f"launcher {launcher.name}: option {option.opts[0]} is taken")
    LAUNCHERS[launcher.name] = launcher
    return launcher


register_launcher(LocalLauncher())
register_launcher(SlurmLauncher())


def launcher_of(attrs: dict[str, Any]) -> Launcher:
    """The launcher of a study's stored attrs (studies made before launchers existed: local)."""
    name = attrs.get("name", "local")
    if name not in LAUNCHERS:
        raise UserError(
            f"the study's launcher {printable(repr(name))} is not one of: {', '.join(LAUNCHERS)}"
        )
    return LAUNCHERS[name]


# --- the commands' side (their click options: autotune/commands/options.py) ------------------


def launcher_attrs(
    stored: dict[str, Any], given: dict[str, Any], gpus_per_node: int = 0
) -> dict[str, Any]:
    """The launcher a command uses: the one stored with the study (``stored``), changed by the
    options ``given`` (``--launcher`` and the launchers' own, by parameter name)."""
    chosen = LAUNCHERS[given["launcher"]] if given.get("launcher") else launcher_of(stored)
    for other in LAUNCHERS.values():
        if other is chosen:
            continue
        for option in other.click_options:
            if given.get(option.name):
                raise UserError(
                    f"{option.opts[0]} is a {other.label} option: add --launcher {other.name}"
                )
    own = {o.name: given.get(o.name) for o in chosen.click_options}
    return chosen.settings(stored if stored.get("name") == chosen.name else None, own,
                           gpus_per_node)  # fmt: skip


#: seconds between looks at the Slurm queue (tests use less than the default 5)
POLL_ENV = "AUTOTUNE_SLURM_POLL_S"


def make_runner(attrs: dict[str, Any], workdir: Path, timeout_s: float) -> TrialRunner:
    """The runner of a launcher's stored attrs."""
    return launcher_of(attrs).runner(attrs, workdir, timeout_s)


def concurrency(attrs: dict[str, Any]) -> int:
    """Trials at once, as the stored launcher runs them."""
    return launcher_of(attrs).concurrency(attrs)
