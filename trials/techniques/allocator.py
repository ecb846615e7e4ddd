"""The CUDA caching allocator's ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments``: less
fragmentation, a lower reserved peak; exact. The runner sets the variable per trial
(``trials.cuda.alloc_conf_with``), since the allocator reads it when the process starts."""

from __future__ import annotations

from trials.hardware import needs_cuda
from trials.techniques.base import Knob, Technique


class Allocator(Technique):
    family = "allocator"
    # the whole dimension is dropped where it means nothing (on a CPU), with one line
    knobs = (
        Knob(
            "expandable_segments",
            (False, True),
            requires_dimension=needs_cuda,
            short=lambda v: "expseg" if v else "",
        ),
    )


TECHNIQUE = Allocator()
