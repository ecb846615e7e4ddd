"""A user's dataset in a trial job: the documents file the controller wrote, read back.

``autotune run --data`` tokenizes the user's data once (``autotune.data_source``) and writes the
documents a trial trains on, in the order it trains on them, to one file: ``MAGIC``, the count
N (int64), N + 1 offsets (int64: where each document starts, and the end), then every
document's ids one after another (int32), all little-endian: the same documents always make
the same bytes (an ``.npz`` would not: its zip entries carry the time). The spec names the
file, its SHA-256 and the
documents' token lengths (``TrialSpec.data``); a job refuses a file whose hash or lengths are
not those, so a trial never measures other data than the study's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trials.data import DatasetDocuments

if TYPE_CHECKING:
    import numpy as np
    import torch

MAGIC = b"autotune-documents-1\n"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_documents(path: Path, documents: list[list[int]]) -> str:
    """Write ``documents`` (token ids, in the trial's order) to ``path``; returns its SHA-256."""
    import numpy as np

    offsets = np.zeros(len(documents) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([len(d) for d in documents])
    tokens = np.fromiter((t for d in documents for t in d), dtype="<i4", count=int(offsets[-1]))
    path.parent.mkdir(parents=True, exist_ok=True)
    # a writer's own temporary file: probes of several threads or processes may write one file
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with tmp.open("wb") as f:
        f.write(MAGIC)
        f.write(np.array([len(documents)], dtype="<i8").tobytes())
        f.write(offsets.tobytes())
        f.write(tokens.tobytes())
    tmp.replace(path)
    return file_sha256(path)


class TokenStore:
    """The documents of the file, by position."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens = tokens
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> list[int]:
        return [int(b - a) for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)]

    def document(self, position: int) -> torch.Tensor:
        import torch

        a, b = int(self.offsets[position]), int(self.offsets[position + 1])
        return torch.from_numpy(self.tokens[a:b].astype("int64"))


@functools.lru_cache(maxsize=4)
def load_store(path: str, sha256: str) -> TokenStore:
    """The documents file at ``path``; a ``ValueError`` if its hash is not ``sha256``."""
    import numpy as np

    found = file_sha256(Path(path))
    if found != sha256:
        raise ValueError(f"the trial's documents file {path} has SHA-256 {found[:12]}..., "
                         f"not the study's {sha256[:12]}...")  # fmt: skip
    raw = Path(path).read_bytes()
    if not raw.startswith(MAGIC):
        raise ValueError(f"{path} is not a documents file autotune wrote")
    at = len(MAGIC)
    n = int(np.frombuffer(raw, dtype="<i8", count=1, offset=at)[0])
    offsets = np.frombuffer(raw, dtype="<i8", count=n + 1, offset=at + 8)
    tokens = np.frombuffer(raw, dtype="<i4", offset=at + 8 + 8 * (n + 1))
    return TokenStore(tokens, offsets)


def dataset_documents(
    data: dict[str, Any], seed: int, steps: int, timed: tuple[int, int], with_tokens: bool
) -> DatasetDocuments:
    """A spec's ``data`` as the documents of its trial (``with_tokens``: their ids loaded, in a
    job; the estimator needs the lengths only)."""
    order = tuple(int(n) for n in data["order"])
    store = None
    if with_tokens:
        store = load_store(str(data["file"]), str(data["sha256"]))
        if tuple(store.lengths()) != order:
            raise ValueError(f"the trial's documents file {data['file']} holds other documents "
                             "than the study's")  # fmt: skip
    return DatasetDocuments(min(order), max(order), seed, steps, order, timed, store)
