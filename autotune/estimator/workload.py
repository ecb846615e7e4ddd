"""What is trained and on what: the one argument that carries a study's workload into the
estimators (``Estimator.estimate``, the roofline, the traced step, the model states).

A workload is the model, its data's shape (sequence length, global batch, variable-length
documents) and the machines (processes, nodes, the GPU); a configuration (the technique
choices, a separate argument everywhere) is how it is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.estimator.gpus import GpuSpec
from trials.data import Documents


@dataclass(frozen=True)
class Workload:
    #: the model's transformers config dict (``autotune.models.MODELS``)
    model_config: dict[str, Any]
    #: positions per sequence (the study's sequence length)
    seq_len_tokens: int
    #: sequences per optimizer step, over all processes
    global_batch_sequences: int
    #: training processes (ranks: one per GPU), over all nodes
    processes: int = 1
    #: machines the processes spread over, ``processes / nodes`` each
    nodes: int = 1
    #: the GPU one process runs on; None: the CPU trial backend (no speed predicted)
    gpu: GpuSpec | None = None
    #: variable-length data (``trials.data``); None: every row ``seq_len_tokens`` long
    documents: Documents | None = None

    @property
    def device(self) -> GpuSpec | None:
        """The GPU as the estimators price it: ``gpu`` in ``nodes`` nodes (ZeRO's collectives
        over the nodes' network, host memory per node; ``GpuSpec.spanning``)."""
        if self.gpu is None or self.nodes <= 1:
            return self.gpu
        return self.gpu.spanning(self.nodes, self.processes // self.nodes)
