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

Each card sits in a ``Machine``: its host link and the node's network (``internode_gbps``, per
direction, all its NICs together): the DGX H100/H200 has eight 400 Gb/s ConnectX-7 InfiniBand NICs
(one per GPU: 8 x 50 GB/s), the DGX A100 eight 200 Gb/s HDR NICs (8 x 25 GB/s), the DGX-1 V100 four
100 Gb/s EDR (4 x 12.5 GB/s) (NVIDIA's DGX datasheets); cards without NVLink sit in PCIe servers,
here with one 100 Gb/s Ethernet link (12.5 GB/s). A ring collective whose ranks span nodes moves
every byte through the slowest hop, the node's network shared by its GPUs (``interconnect_gbps``
of a spec made by ``spanning``).

Units are in the field names: ``_bytes``, ``_tflops`` (10**12 FLOP/s), ``_gbps`` (GB/s: 10**9
bytes per second, not gigabits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autotune.errors import UserError

GB = 10**9
GIB = 2**30
TERA = 10**12


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The server a card sits in, as the speed model prices it beyond the card itself.

    Bandwidths in GB/s (``gbps``: 10**9 bytes per second), per direction."""

    name: str
    pcie_gbps: float  # each GPU's host link (PCIe x16; NVLink-C2C on Grace Hopper)
    internode_gbps: float  # the node's network, all its NICs together
    #: the server's system memory (host RAM), GiB; None: not published for the kind of server
    #: (a PCIe box's is its owner's choice): ``--host-memory`` gives it, else no host limit
    host_memory_gib: int | None = None


#: NVIDIA's DGX datasheets: eight 400 Gb/s ConnectX-7 InfiniBand NICs (one per GPU, 8 x 50 GB/s);
#: system memory 2 TB (DGX H100 and DGX H200 datasheets: "System Memory 2TB")
DGX_H100 = Machine(name="DGX H100/H200", pcie_gbps=64, internode_gbps=400.0, host_memory_gib=2048)
#: eight 200 Gb/s HDR InfiniBand NICs (8 x 25 GB/s); system memory 2 TB with the 80 GB cards
#: (DGX A100 640GB), 1 TB with the 40 GB ones (DGX A100 320GB) (DGX A100 datasheet)
DGX_A100 = Machine(name="DGX A100", pcie_gbps=32, internode_gbps=200.0, host_memory_gib=2048)
DGX_A100_320GB = Machine(
    name="DGX A100 320GB", pcie_gbps=32, internode_gbps=200.0, host_memory_gib=1024
)
#: four 100 Gb/s EDR InfiniBand NICs (4 x 12.5 GB/s); system memory 512 GB DDR4 (DGX-1
#: datasheet)
DGX1_V100 = Machine(name="DGX-1 V100", pcie_gbps=16, internode_gbps=50.0, host_memory_gib=512)
#: a PCIe server with one 100 Gb/s Ethernet link (12.5 GB/s)
PCIE4_SERVER = Machine(name="PCIe 4.0 server", pcie_gbps=32, internode_gbps=12.5)
PCIE5_SERVER = Machine(name="PCIe 5.0 server", pcie_gbps=64, internode_gbps=12.5)
#: the Grace Hopper superchip: its host link is NVLink-C2C (900 GB/s both ways)
#: its Grace CPU's 480 GB LPDDR5X (NVIDIA GH200 Grace Hopper Superchip datasheet)
GH200_NODE = Machine(name="GH200 node", pcie_gbps=450, internode_gbps=12.5, host_memory_gib=480)


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One card: its datasheet figures and the machine it sits in.

    ``device_names``: the names the driver reports for this card (``nvidia-smi
    --query-gpu=name``, ``torch.cuda.get_device_name``), matched whole, ignoring case and a
    leading "NVIDIA " (older drivers leave it out); a detected card takes the one row that lists
    its name (``gpu_for_device``)."""

    key: str
    name: str
    memory_bytes: int
    bf16_tflops: float  # 0 when the GPU has no bf16 tensor cores
    fp16_tflops: float
    fp32_tflops: float
    hbm_gbps: float  # device memory bandwidth, GB/s
    nvlink_gbps: float  # GPU-GPU per direction, GB/s (0: PCIe only)
    sm: tuple[int, int]  # CUDA compute capability
    machine: Machine
    device_names: tuple[str, ...] = ()
    gpus_per_node: int = 8  # ranks sharing the node's network (set by ``spanning``)
    nodes: int = 1  # nodes the ranks span (set by ``spanning``)

    @property
    def pcie_gbps(self) -> float:
        """The host link, per direction, GB/s (the machine's)."""
        return self.machine.pcie_gbps

    @property
    def host_memory_bytes(self) -> int | None:
        """The machine's host RAM in bytes (None: not known)."""
        gib = self.machine.host_memory_gib
        return None if gib is None else gib * GIB

    @property
    def internode_gbps(self) -> float:
        """The node's network, per direction, GB/s, all NICs (the machine's)."""
        return self.machine.internode_gbps

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
        GpuSpec(
            key="h200",
            name="NVIDIA H200 SXM 141GB",
            device_names=("NVIDIA H200",),
            memory_bytes=141 * GB,
            bf16_tflops=989,
            fp16_tflops=989,
            fp32_tflops=67,
            hbm_gbps=4800,
            nvlink_gbps=450,
            sm=(9, 0),
            machine=DGX_H100,
        ),
        GpuSpec(
            key="h100",
            name="NVIDIA H100 SXM 80GB",
            device_names=("NVIDIA H100 80GB HBM3",),
            memory_bytes=80 * GB,
            bf16_tflops=989,
            fp16_tflops=989,
            fp32_tflops=67,
            hbm_gbps=3350,
            nvlink_gbps=450,
            sm=(9, 0),
            machine=DGX_H100,
        ),
        # the PCIe A100s of the same memory are priced with the SXM card (same tensor cores)
        GpuSpec(
            key="a100-80gb",
            name="NVIDIA A100 SXM 80GB",
            device_names=(
                "NVIDIA A100-SXM4-80GB",
                "NVIDIA A100-SXM-80GB",
                "NVIDIA PG509-210",
                "NVIDIA A100 80GB PCIe",
            ),
            memory_bytes=80 * GB,
            bf16_tflops=312,
            fp16_tflops=312,
            fp32_tflops=19.5,
            hbm_gbps=2039,
            nvlink_gbps=300,
            sm=(8, 0),
            machine=DGX_A100,
        ),
        GpuSpec(
            key="a100-40gb",
            name="NVIDIA A100 SXM 40GB",
            device_names=(
                "NVIDIA A100-SXM4-40GB",
                "NVIDIA A100-PG509-200",
                "NVIDIA A100-PCIE-40GB",
            ),
            memory_bytes=40 * GB,
            bf16_tflops=312,
            fp16_tflops=312,
            fp32_tflops=19.5,
            hbm_gbps=1555,
            nvlink_gbps=300,
            sm=(8, 0),
            machine=DGX_A100_320GB,
        ),
        # the PCIe V100s of the same memory are priced with the SXM2 card
        GpuSpec(
            key="v100",
            name="NVIDIA V100 SXM2 32GB",
            device_names=("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB"),
            memory_bytes=32 * GIB,
            bf16_tflops=0,
            fp16_tflops=125,
            fp32_tflops=15.7,
            hbm_gbps=900,
            nvlink_gbps=150,
            sm=(7, 0),
            machine=DGX1_V100,
        ),
        GpuSpec(
            key="rtx4090",
            name="NVIDIA GeForce RTX 4090",
            device_names=("NVIDIA GeForce RTX 4090",),
            memory_bytes=24 * GIB,
            bf16_tflops=165.2,
            fp16_tflops=165.2,
            fp32_tflops=82.6,
            hbm_gbps=1008,
            nvlink_gbps=0,
            sm=(8, 9),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="rtx3090",
            name="NVIDIA GeForce RTX 3090",
            device_names=("NVIDIA GeForce RTX 3090",),
            memory_bytes=24 * GIB,
            bf16_tflops=71,
            fp16_tflops=71,
            fp32_tflops=35.6,
            hbm_gbps=936,
            nvlink_gbps=56,
            sm=(8, 6),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="a10g",
            name="NVIDIA A10G 24GB",
            device_names=("NVIDIA A10G",),
            memory_bytes=24 * GIB,
            bf16_tflops=125,
            fp16_tflops=125,
            fp32_tflops=31.2,
            hbm_gbps=600,
            nvlink_gbps=0,
            sm=(8, 6),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="l4",
            name="NVIDIA L4 24GB",
            device_names=("NVIDIA L4",),
            memory_bytes=24 * GIB,
            bf16_tflops=121,
            fp16_tflops=121,
            fp32_tflops=30.3,
            hbm_gbps=300,
            nvlink_gbps=0,
            sm=(8, 9),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="a10",
            name="NVIDIA A10 24GB",
            device_names=("NVIDIA A10",),
            memory_bytes=24 * GIB,
            bf16_tflops=125,
            fp16_tflops=125,
            fp32_tflops=31.2,
            hbm_gbps=600,
            nvlink_gbps=0,
            sm=(8, 6),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="rtx-a6000",
            name="NVIDIA RTX A6000 48GB",
            device_names=("NVIDIA RTX A6000",),
            memory_bytes=48 * GIB,
            bf16_tflops=154.8,
            fp16_tflops=154.8,
            fp32_tflops=38.7,
            hbm_gbps=768,
            nvlink_gbps=56,
            sm=(8, 6),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="l40s",
            name="NVIDIA L40S 48GB",
            device_names=("NVIDIA L40S",),
            memory_bytes=48 * GIB,
            bf16_tflops=362,
            fp16_tflops=362,
            fp32_tflops=91.6,
            hbm_gbps=864,
            nvlink_gbps=0,
            sm=(8, 9),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="rtx6000-ada",
            name="NVIDIA RTX 6000 Ada 48GB",
            device_names=("NVIDIA RTX 6000 Ada Generation",),
            memory_bytes=48 * GIB,
            bf16_tflops=364,
            fp16_tflops=364,
            fp32_tflops=91.1,
            hbm_gbps=960,
            nvlink_gbps=0,
            sm=(8, 9),
            machine=PCIE4_SERVER,
        ),
        GpuSpec(
            key="h100-pcie",
            name="NVIDIA H100 PCIe 80GB",
            device_names=("NVIDIA H100 PCIe",),
            memory_bytes=80 * GB,
            bf16_tflops=756,
            fp16_tflops=756,
            fp32_tflops=51,
            hbm_gbps=2000,
            nvlink_gbps=300,
            sm=(9, 0),
            machine=PCIE5_SERVER,
        ),
        GpuSpec(
            key="h100-nvl",
            name="NVIDIA H100 NVL 94GB",
            device_names=("NVIDIA H100 NVL",),
            memory_bytes=94 * GB,
            bf16_tflops=835,
            fp16_tflops=835,
            fp32_tflops=60,
            hbm_gbps=3900,
            nvlink_gbps=300,
            sm=(9, 0),
            machine=PCIE5_SERVER,
        ),
        # the Grace Hopper superchip's GPU (96 GB of HBM3; the superchip's name counts its
        # CPU's memory too)
        GpuSpec(
            key="h100-96gb",
            name="NVIDIA H100 96GB (GH200)",
            device_names=("NVIDIA GH200 480GB",),
            memory_bytes=96 * GB,
            bf16_tflops=989,
            fp16_tflops=989,
            fp32_tflops=67,
            hbm_gbps=4000,
            nvlink_gbps=450,
            sm=(9, 0),
            machine=GH200_NODE,
        ),
        GpuSpec(
            key="v100-16gb",
            name="NVIDIA V100 SXM2 16GB",
            device_names=("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB"),
            memory_bytes=16 * GIB,
            bf16_tflops=0,
            fp16_tflops=125,
            fp32_tflops=15.7,
            hbm_gbps=900,
            nvlink_gbps=150,
            sm=(7, 0),
            machine=DGX1_V100,
        ),
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


def _device_key(device_name: str) -> str:
    """A driver's card name compared whole: case and spacing ignored, and the "NVIDIA " that
    older drivers leave out (``A100-SXM4-40GB``, ``GeForce RTX 3090``)."""
    name = " ".join(device_name.split()).lower()
    return name.removeprefix("nvidia ")


def gpus_for_device(device_name: str) -> list[GpuSpec]:
    """Every row that lists ``device_name`` among its ``device_names`` (one at most, as the
    table's test checks)."""
    wanted = _device_key(device_name)
    return [g for g in GPUS.values() if any(_device_key(n) == wanted for n in g.device_names)]


def gpu_for_device(device_name: str) -> GpuSpec | None:
    """The row of a detected card, by the name its driver reports; None for a card no row
    lists (the speed prior then stays nominal)."""
    rows = gpus_for_device(device_name)
    return rows[0] if len(rows) == 1 else None
