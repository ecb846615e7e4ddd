"""The CUDA caching allocator's ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments``: less
fragmentation, a lower reserved peak; exact. The runner sets the variable per trial
(``trials.cuda.alloc_conf_with``), since the allocator reads it when the process starts."""

from __future__ import annotations

from collections.abc import Mapping

from trials.cuda import ALLOC_CONF_ENV, alloc_conf_with
from trials.hardware import needs_cuda
from trials.techniques.base import Config, Knob, Technique

EXPANDABLE = "expandable_segments"


class Allocator(Technique):
    family = "allocator"
    # the whole dimension is dropped where it means nothing (on a CPU), with one line
    knobs = (
        Knob(
            EXPANDABLE,
            (False, True),
            requires_dimension=needs_cuda,
            short=lambda v: "expseg" if v else "",
        ),
    )

    def environment(self, config: Config, inherited: Mapping[str, str]) -> dict[str, str]:
        if EXPANDABLE not in config:
            return {}
        conf = alloc_conf_with(inherited.get(ALLOC_CONF_ENV, ""), bool(config[EXPANDABLE]))
        return {ALLOC_CONF_ENV: conf}


TECHNIQUE = Allocator()
