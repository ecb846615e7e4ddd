"""The estimator's formulas that technique terms call (``trials.techniques.terms.Formulas``):
handed to them on the step, so that the technique modules import nothing from here."""

from __future__ import annotations

from typing import Any

from autotune.estimator import activations, states
from trials.techniques.terms import Config


class Library:
    """``trials.techniques.terms.Formulas`` over ``activations.py`` and ``states.py``."""

    def saved_op_bytes(self, st: Any, config: Config, length: int, micro: int) -> int:
        return activations.saved_op_bytes(st, dict(config), length, micro)

    def zero_states_at(self, phases: Any, moment: str, accum: int) -> dict[str, int]:
        return states.zero_states_at(phases, moment, accum)

    def fsdp_held(
        self, st: Any, config: Config, n: int, moment: str, accum: int, cuda: bool
    ) -> dict[str, int]:
        return states.fsdp_held(st, dict(config), n, moment, accum, cuda)

    def adapter_activation_bytes(self, st: Any, config: Config, tokens: int) -> int:
        return activations.adapter_activation_bytes(st, dict(config), tokens)


FORMULAS = Library()
