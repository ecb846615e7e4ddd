"""A build lock left by a process killed mid-build (torch's ``FileBaton``: the file exists, nothing
holds it) must not hang every later DeepSpeed trial until its time limit: the trial removes locks
whose build directory has been idle for ten minutes, and leaves a build in progress alone."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from autotune.runner import SubprocessRunner
from tests.conftest import tiny_spec
from trials.extensions import STALE_AFTER_S, build_root, clear_stale_locks

HOUR = 3600.0


def _build_dir(root: Path, name: str, age_s: float, *, lock: bool = True) -> Path:
    """A build directory as torch leaves it: an object file and, while building, ``lock``;
    every entry last written ``age_s`` seconds ago."""
    directory = root / "py311_cpu" / name
    directory.mkdir(parents=True)
    (directory / "op.o").write_bytes(b"\0" * 16)
    if lock:
        (directory / "lock").touch()
    stamp = time.time() - age_s
    for path in [*directory.iterdir(), directory]:
        os.utime(path, (stamp, stamp))
    return directory


def test_an_abandoned_lock_is_removed_and_a_live_build_keeps_its_own(tmp_path: Path) -> None:
    abandoned = _build_dir(tmp_path, "cpu_adam", HOUR)
    building = _build_dir(tmp_path, "deepspeed_shm_comm", HOUR)
    # ninja just finished an object file of this build: it is alive although its lock is old
    (building / "shm.o").write_bytes(b"\0")
    young = _build_dir(tmp_path, "fused_adam", 60)
    finished = _build_dir(tmp_path, "quantizer", HOUR, lock=False)

    removed = clear_stale_locks(tmp_path)

    assert removed == [abandoned / "lock"]
    assert not (abandoned / "lock").exists()
    assert (building / "lock").exists() and (young / "lock").exists()
    assert sorted(p.name for p in finished.iterdir()) == ["op.o"]  # nothing else touched
    assert (abandoned / "op.o").exists()


def test_the_age_limit_is_the_one_given(tmp_path: Path) -> None:
    directory = _build_dir(tmp_path, "cpu_adam", 100)
    assert clear_stale_locks(tmp_path, stale_after_s=200) == []
    assert clear_stale_locks(tmp_path, stale_after_s=50) == [directory / "lock"]
    assert STALE_AFTER_S >= 300  # above a cold two-core build of cpu_adam (1-3 minutes)


def test_the_build_root_is_torchs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_root() == tmp_path


@pytest.mark.slow
def test_a_deepspeed_trial_runs_through_a_stale_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real ZeRO-1 trial (DeepSpeed loads its shm comm op on the CPU, one rank too) over an
    extension directory with an hour-old lock in the op's build directory: without the sweep it
    waits until the runner's time limit."""
    root = tmp_path / "extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_" + (
        "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    )
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    built = build_root() / tag / "deepspeed_shm_comm"
    op_dir = root / "deepspeed_shm_comm"  # under TORCH_EXTENSIONS_DIR torch adds no tag
    if built.is_dir():  # the op as this machine already built it: the trial need not rebuild it
        shutil.copytree(built, op_dir, ignore=shutil.ignore_patterns("lock"))
    else:
        op_dir.mkdir(parents=True)
    (op_dir / "lock").touch()
    stamp = time.time() - HOUR
    for path in [*op_dir.iterdir(), op_dir]:
        os.utime(path, (stamp, stamp))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))

    spec = tiny_spec({"zero_stage": 1, "precision": "bf16"}, nproc=1, measured_steps=1)
    result = SubprocessRunner(tmp_path / "trials", timeout_s=300).run(spec, "t")

    assert result.status == "ok", result.error + result.stderr_tail
    assert not (op_dir / "lock").exists()
