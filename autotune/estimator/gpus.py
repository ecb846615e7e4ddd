"""GPU spec table for the speed model and for choosing a target GPU without one.

Dense (no structured sparsity) peak tensor-core throughput, from NVIDIA's datasheets and
architecture whitepapers: H100/H200 SXM datasheets, A100 datasheet (SXM), A10 and L4
datasheets, the Ada Lovelace whitepaper (RTX 4090: FP16/BF16 with FP32 accumulate) and the
Ampere GA102 whitepaper (RTX 3090, same; RTX A6000 at the full FP32-accumulate rate, its
datasheet's 309.7 sparse TFLOPS halved), the L40S and RTX 6000 Ada datasheets (733 and 728
sparse, halved), the H100 PCIe and H100 NVL datasheets (1,513 and 1,671 sparse, halved), the
GH200 datasheet (H100 96GB, its host link NVLink-C2C at 450 GB/s per direction), the V100 SXM2
datasheets (16 and 32 GB; no bf16). ``fp32`` is the
plain (non-TF32) FP32 rate. Link bandwidths are per direction: PCIe 3/4/5 x16 = 16/32/64 GB/s;
NVLink is the datasheet's total per GPU divided by two.

Between nodes (``internode_gbps``, the node's network per direction, all its NICs together):
the DGX H100/H200 has eight 400 Gb/s ConnectX-7 InfiniBand NICs (one per GPU: 8 x 50 GB/s), the
DGX A100 eight 200 Gb/s HDR NICs (8 x 25 GB/s), the DGX-1 V100 four 100 Gb/s EDR (4 x 12.5 GB/s)
(NVIDIA's DGX datasheets); cards without NVLink sit in PCIe servers, here with one 100 Gb/s
Ethernet link (12.5 GB/s). A ring collective whose ranks span nodes moves every byte through
the slowest hop, the node's network shared by its GPUs (``interconnect_gbps`` of a spec made by
``spanning``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autotune.errors import UserError

GB = 10**9
GIB = 2**30
TERA = 10**12


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    memory_bytes: int
    bf16_tflops: float  # 0 when the GPU has no bf16 tensor cores
    fp16_tflops: float
    fp32_tflops: float
    hbm_gbps: float  # device memory bandwidth, GB/s
    pcie_gbps: float  # host link, per direction, GB/s
    nvlink_gbps: float  # GPU-GPU per direction, GB/s (0: PCIe only)
    sm: tuple[int, int]  # CUDA compute capability
    internode_gbps: float = 12.5  # the node's network, per direction, GB/s (all NICs)
    gpus_per_node: int = 8  # GPUs sharing that network
    nodes: int = 1  # nodes the ranks span (set by ``spanning``)

    def flops_per_s(self, precision: str) -> float:
        tflops = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops}.get(
            precision, self.fp32_tflops
        )
        return tflops * TERA

    @property
    def interconnect_gbps(self) -> float:
        """GPU-to-GPU bandwidth of a collective: NVLink (or PCIe) in one node; across nodes the
        node's network shared by its GPUs, when that is the slower hop."""
        intra = self.nvlink_gbps or self.pcie_gbps
        if self.nodes <= 1:
            return intra
        return min(intra, self.internode_gbps / max(1, self.gpus_per_node))

    def spanning(self, nodes: int, gpus_per_node: int) -> GpuSpec:
        """This GPU in ``nodes`` nodes of ``gpus_per_node`` each (what the speed model prices)."""
        return replace(self, nodes=max(1, nodes), gpus_per_node=max(1, gpus_per_node))


GPUS: dict[str, GpuSpec] = {
    g.key: g
    for g in [
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", 141 * GB, 989, 989, 67, 4800, 64, 450, (9, 0)),
        GpuSpec("h100", "NVIDIA H100 SXM 80GB", 80 * GB, 989, 989, 67, 3350, 64, 450, (9, 0)),
        GpuSpec(
            "a100-80gb", "NVIDIA A100 SXM 80GB", 80 * GB, 312, 312, 19.5, 2039, 32, 300, (8, 0)
        ),
        GpuSpec(
            "a100-40gb", "NVIDIA A100 SXM 40GB", 40 * GB, 312, 312, 19.5, 1555, 32, 300, (8, 0)
        ),
        GpuSpec("v100", "NVIDIA V100 SXM2 32GB", 32 * GIB, 0, 125, 15.7, 900, 16, 150, (7, 0)),
        GpuSpec(
            "rtx4090", "NVIDIA GeForce RTX 4090", 24 * GIB, 165.2, 165.2, 82.6, 1008, 32, 0, (8, 9)
        ),
        GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090", 24 * GIB, 71, 71, 35.6, 936, 32, 56, (8, 6)),
        GpuSpec("a10g", "NVIDIA A10G 24GB", 24 * GIB, 125, 125, 31.2, 600, 32, 0, (8, 6)),
        GpuSpec("l4", "NVIDIA L4 24GB", 24 * GIB, 121, 121, 30.3, 300, 32, 0, (8, 9)),
        GpuSpec("a10", "NVIDIA A10 24GB", 24 * GIB, 125, 125, 31.2, 600, 32, 0, (8, 6)),
        GpuSpec(
            "rtx-a6000", "NVIDIA RTX A6000 48GB", 48 * GIB, 154.8, 154.8, 38.7, 768, 32, 56, (8, 6)
        ),
        GpuSpec("l40s", "NVIDIA L40S 48GB", 48 * GIB, 362, 362, 91.6, 864, 32, 0, (8, 9)),
        GpuSpec(
            "rtx6000-ada", "NVIDIA RTX 6000 Ada 48GB", 48 * GIB, 364, 364, 91.1, 960, 32, 0, (8, 9)
        ),
        GpuSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", 80 * GB, 756, 756, 51, 2000, 64, 300, (9, 0)),
        GpuSpec("h100-nvl", "NVIDIA H100 NVL 94GB", 94 * GB, 835, 835, 60, 3900, 64, 300, (9, 0)),
        # the Grace Hopper superchip's GPU: its host link is NVLink-C2C (900 GB/s both ways)
        GpuSpec(
            "h100-96gb", "NVIDIA H100 96GB (GH200)", 96 * GB, 989, 989, 67, 4000, 450, 450, (9, 0)
        ),
        GpuSpec("v100-16gb", "NVIDIA V100 SXM2 16GB", 16 * GIB, 0, 125, 15.7, 900, 16, 150, (7, 0)),
    ]
}
#: the cards ``default_gpu`` picks from (the common card of each memory size)
DEFAULT_CHOICES = (
    "h200",
    "h100",
    "a100-80gb",
    "a100-40gb",
    "v100",
    "rtx4090",
    "rtx3090",
    "a10g",
    "l4",
)


#: the node's network per GPU model (GB/s per direction, all NICs): DGX-class InfiniBand for the
#: data-centre GPUs, 100 Gb/s Ethernet (the field's default) for the others
INTERNODE_GBPS = {
    "h200": 400.0,
    "h100": 400.0,
    "a100-80gb": 200.0,
    "a100-40gb": 200.0,
    "v100": 50.0,
    "v100-16gb": 50.0,
}
GPUS = {
    k: replace(g, internode_gbps=INTERNODE_GBPS.get(k, g.internode_gbps)) for k, g in GPUS.items()
}


def gpu_spec(key: str) -> GpuSpec:
    k = key.lower().replace("_", "-").replace(" ", "")
    if k in GPUS:
        return GPUS[k]
    raise UserError(f"unknown GPU '{key}' (known: {', '.join(GPUS)})")


def default_gpu(budget_bytes: int) -> GpuSpec:
    """The smallest card whose memory holds the budget (the fastest of equals); else the
    largest card. A 24GB budget gets an RTX 4090."""
    choices = [GPUS[k] for k in DEFAULT_CHOICES]
    fitting = [g for g in choices if g.memory_bytes >= budget_bytes]
    if not fitting:
        return max(choices, key=lambda g: g.memory_bytes)
    smallest = min(g.memory_bytes for g in fitting)
    return max(
        (g for g in fitting if g.memory_bytes == smallest),
        key=lambda g: g.flops_per_s("bf16"),
    )
