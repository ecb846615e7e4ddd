"""Backends: where a study's numbers come from, as the commands ask about them (a row each, by
the name stored with the study). A new backend is a row of ``BACKENDS``; the commands read its
fields, never its name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autotune.errors import UserError
from autotune.terminal import printable


@dataclass(frozen=True)
class Backend:
    name: str
    #: trials measure a real job (False: the estimator predicts them): a loss reference and
    #: probes, the finalists re-measured, the search's contenders, a launcher
    measures: bool = True
    #: trials run on CUDA GPUs (a rank per GPU): a worker needs one here unless its launcher
    #: runs them elsewhere; the loss probes train there too
    cuda: bool = False

    @property
    def device(self) -> Literal["cpu", "cuda"]:
        """The device kind of a job of this backend (a trial's, a loss probe's)."""
        return "cuda" if self.cuda else "cpu"

    def gpus_per_node(self, nproc: int, nodes: int) -> int:
        """The GPUs each node of a trial of ``nproc`` ranks over ``nodes`` uses (0: none)."""
        return nproc // nodes if self.cuda else 0


BACKENDS = {
    "cpu": Backend("cpu"),
    "cuda": Backend("cuda", cuda=True),
    "estimate": Backend("estimate", measures=False),
}


def backend_named(name: str) -> Backend:
    """The backend stored with a study."""
    if name not in BACKENDS:
        raise UserError(f"the study's backend {printable(repr(name))} is not one of: "
                        f"{', '.join(BACKENDS)}")  # fmt: skip
    return BACKENDS[name]
