"""A backend added as a row of ``BACKENDS`` alone: the plan's rank checks and a trial's
environment follow its fields (``cuda``, ``measures``), with no command module naming it."""

from __future__ import annotations

import pytest

from autotune import backends
from autotune.backends import Backend
from autotune.errors import UserError
from autotune.plan import ranks_per_node
from autotune.runner import trial_env
from tests.conftest import tiny_spec
from trials.hardware import Hardware


@pytest.fixture
def gpu_row(monkeypatch: pytest.MonkeyPatch) -> str:
    """A GPU backend that no module names: a row with ``cuda=True``."""
    monkeypatch.setitem(backends.BACKENDS, "othergpu", Backend("othergpu", cuda=True))
    return "othergpu"


def test_a_new_gpu_backend_plans_gpus_not_processes(gpu_row: str) -> None:
    hardware = Hardware(backend=gpu_row, gpu_count=2)
    assert ranks_per_node(1, None, 2, None, None, hardware, None) == 2
    with pytest.raises(UserError, match="--nproc is for CPU trials"):
        ranks_per_node(1, 2, None, None, None, hardware, None)
    with pytest.raises(UserError, match="--nproc-per-node is for CPU trials"):
        ranks_per_node(2, None, None, 2, None, hardware, None)
    # the CPU row plans processes: the same call the other way round
    with pytest.raises(UserError, match="--gpus needs the cuda backend"):
        ranks_per_node(1, None, 2, None, None, Hardware(backend="cpu"), None)


def test_a_new_gpu_backend_gets_the_allocator_environment(gpu_row: str) -> None:
    env = trial_env({}, tiny_spec({"expandable_segments": True}, backend=gpu_row))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    cpu = trial_env({}, tiny_spec({"expandable_segments": True}, backend="cpu"))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in cpu
