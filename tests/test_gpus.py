"""The GPU table (``autotune/estimator/gpus.py``): a detected card takes the one row that lists the
name its driver reports, and no other.

The names are the drivers' own: the table of compatible GPUs in the README of NVIDIA's
open-gpu-kernel-modules (what ``nvidia-smi --query-gpu=name`` and ``torch.cuda.get_device_name``
print), and for the V100 (not in that table) and the drivers before the "NVIDIA " prefix, the names
printed in PyTorch's and DeepSpeed's issue reports (``Tesla V100-SXM2-32GB``, ``A100-SXM4-40GB``,
``GeForce RTX 3090``). Each name's row is written here by hand from the card's datasheet.
"""

from __future__ import annotations

import pytest

from autotune.estimator.gpus import (
    DGX1_V100,
    DGX_A100,
    DGX_H100,
    GPUS,
    gpu_for_device,
    gpus_for_device,
)

#: the name a driver reports -> the row that prices it
REAL_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100",  # SXM5
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",  # SXM
    "NVIDIA GH200 480GB": "h100-96gb",  # Grace Hopper with 96 GB of HBM3
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "A100-SXM4-40GB": "a100-40gb",  # a driver before the prefix (450.x)
    "NVIDIA GeForce RTX 4090": "rtx4090",
    "NVIDIA GeForce RTX 3090": "rtx3090",
    "GeForce RTX 3090": "rtx3090",  # a driver before the prefix (455.x)
    "NVIDIA RTX A6000": "rtx-a6000",
    "NVIDIA RTX 6000 Ada Generation": "rtx6000-ada",
    "NVIDIA L40S": "l40s",
    "NVIDIA L4": "l4",
    "NVIDIA A10": "a10",
    "NVIDIA A10G": "a10g",
    "Tesla V100-SXM2-16GB": "v100-16gb",
    "Tesla V100-SXM2-32GB": "v100",
    "Tesla V100-PCIE-16GB": "v100-16gb",
    "Tesla V100-PCIE-32GB": "v100",
}

#: real cards no row describes: each must stay undetected (a nominal prior), not be priced as
#: a neighbour whose name it contains or resembles
OTHER_CARDS = (
    "Tesla T4",
    "NVIDIA L40",
    "NVIDIA A40",
    "NVIDIA A30",
    "NVIDIA A10M",
    "NVIDIA H100",  # the 94 GB SXM card, not the 80 GB one
    "NVIDIA H200 NVL",
    "NVIDIA H800",
    "NVIDIA H800 PCIe",
    "NVIDIA H20",
    "NVIDIA GH200 120GB",
    "NVIDIA GH200 144G HBM3e",
    "NVIDIA A800-SXM4-80GB",
    "NVIDIA A100-SXM-64GB",
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA GeForce RTX 3080 Ti Laptop GPU",
    "NVIDIA RTX A5000",
    "NVIDIA RTX 5000 Ada Generation",
    "Tesla V100S-PCIE-32GB",
    "NVIDIA B200",
)


@pytest.mark.parametrize("name", sorted(REAL_NAMES))
def test_a_real_card_name_matches_its_own_row_and_no_other(name: str) -> None:
    assert [g.key for g in gpus_for_device(name)] == [REAL_NAMES[name]]
    gpu = gpu_for_device(name)
    assert gpu is not None and gpu.key == REAL_NAMES[name]


@pytest.mark.parametrize("name", OTHER_CARDS)
def test_a_card_no_row_describes_matches_none(name: str) -> None:
    assert gpus_for_device(name) == []
    assert gpu_for_device(name) is None


def test_names_are_compared_whole_ignoring_case_spacing_and_the_vendor_prefix() -> None:
    assert gpu_for_device("  nvidia   geforce rtx 4090 ") is GPUS["rtx4090"]
    assert gpu_for_device("GeForce RTX 4090") is GPUS["rtx4090"]
    assert gpu_for_device("NVIDIA GeForce RTX 4090 (UUID: GPU-0)") is None
    assert gpu_for_device("RTX 4090") is None


def test_every_row_is_detectable_and_lists_names_no_other_row_lists() -> None:
    """Each row lists at least one name, and each listed name belongs to exactly that row: a new
    row that lists a card of another row fails here."""
    assert set(REAL_NAMES.values()) == set(GPUS), "every row has a real name in REAL_NAMES"
    for gpu in GPUS.values():
        assert gpu.device_names, gpu.key
        for name in gpu.device_names:
            assert [g.key for g in gpus_for_device(name)] == [gpu.key], name


def test_the_node_networks_are_the_dgx_datasheets_nics() -> None:
    """Per direction, all NICs together: DGX H100 8 x 400 Gb/s, DGX A100 8 x 200 Gb/s, DGX-1 V100
    4 x 100 Gb/s (8 bits a byte)."""
    assert DGX_H100.internode_gbps == 8 * 400 / 8
    assert DGX_A100.internode_gbps == 8 * 200 / 8
    assert DGX1_V100.internode_gbps == 4 * 100 / 8
    assert GPUS["h100"].internode_gbps == GPUS["h200"].internode_gbps == 400
    assert GPUS["rtx4090"].internode_gbps == 100 / 8  # one 100 Gb/s Ethernet link


def test_rows_are_keyword_only() -> None:
    """A row names every figure: a positional row (the order of ten numbers) is refused."""
    row = GPUS["h100"]
    with pytest.raises(TypeError):
        type(row)("x", "X", 1, 1.0, 1.0, 1.0, 1.0, 1.0, (9, 0), row.machine)  # type: ignore[misc]


def test_the_host_memory_is_the_servers_published_system_memory() -> None:
    """System memory from NVIDIA's datasheets, in GiB of DIMMs: DGX H100 and DGX H200 "2TB",
    DGX A100 640GB "2TB" and DGX A100 320GB "1TB", DGX-1 "512 GB 2,133 MHz DDR4", GH200 Grace
    Hopper "480GB LPDDR5X"; the PCIe cards' servers publish none (None: --host-memory or no
    limit)."""
    tib = 2**40
    assert GPUS["h100"].host_memory_bytes == GPUS["h200"].host_memory_bytes == 2 * tib
    assert GPUS["a100-80gb"].host_memory_bytes == 2 * tib  # eight 80 GB cards: DGX A100 640GB
    assert GPUS["a100-40gb"].host_memory_bytes == tib  # eight 40 GB cards: DGX A100 320GB
    assert GPUS["v100"].host_memory_bytes == 512 * 2**30
    assert GPUS["h100-96gb"].host_memory_bytes == 480 * 2**30
    for key in ("rtx4090", "rtx3090", "a10g", "l4", "l40s", "h100-pcie", "h100-nvl"):
        assert GPUS[key].host_memory_bytes is None, key
    # the 40 GB card's server differs from the 80 GB card's by its memory alone
    forty, eighty = GPUS["a100-40gb"].machine, GPUS["a100-80gb"].machine
    assert (forty.pcie_gbps, forty.internode_gbps) == (eighty.pcie_gbps, eighty.internode_gbps)
