"""What each tracked byte is: parameters, gradients, optimizer states, activations or other.

The CPU tracker (``trials.memory``) numbers every allocation on a timeline. The ledger here keeps
each storage's birth and death on that timeline and a role, given after the fact by whoever
knows it (the engine tags the model's parameters, their ``.grad`` and the optimizer's state
tensors; autograd's saved-tensor hook tags what the forward pass keeps for backward). Because a
role belongs to the storage for its whole life, tagging late is exact: ``roles_at(i)`` sums the
storages alive at timeline entry ``i`` by role, so the breakdown at the peak adds up to the peak.
Untagged bytes (temporaries, logits, the input batch, buffers such as rotary tables, recomputed
activations under checkpointing) are ``other``.
"""

from __future__ import annotations

from array import array

#: roles in order of precedence: a storage tagged twice keeps the earlier role (a weight that
#: autograd saves for backward stays a parameter)
ROLES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "activations", "other")
_OTHER = ROLES.index("other")
_HOST = -1  # offloaded to host memory: not in the device breakdown
_ALIVE = 2**62  # death index of a storage still alive


class StorageLedger:
    """Per storage: born at timeline index ``b``, dead from index ``d`` (alive for ``b <= i < d``),
    its bytes and its role. Records are kept in flat arrays (one entry per storage ever seen)."""

    def __init__(self) -> None:
        self._born = array("q")
        self._died = array("q")
        self._bytes = array("q")
        self._role = array("b")
        self._record: dict[int, int] = {}  # storage key -> record index, while alive

    def born(self, key: int, index: int, nbytes: int) -> None:
        self._record[key] = len(self._born)
        self._born.append(index)
        self._died.append(_ALIVE)
        self._bytes.append(nbytes)
        self._role.append(_OTHER)

    def died(self, key: int, index: int) -> None:
        rec = self._record.pop(key, None)
        if rec is not None:
            self._died[rec] = index

    def nbytes(self, key: int) -> int | None:
        """The bytes of a live storage's record (None: not alive here)."""
        rec = self._record.get(key)
        return None if rec is None else self._bytes[rec]

    def tag(self, key: int, role: str) -> None:
        """Give a live storage a role, unless it has one that takes precedence (or is host)."""
        rec = self._record.get(key)
        if rec is None:
            return
        new = ROLES.index(role)
        if 0 <= new < self._role[rec]:
            self._role[rec] = new

    def host(self, key: int) -> None:
        """This storage lives in host memory (offloaded): leave it out of the device's roles."""
        rec = self._record.get(key)
        if rec is not None:
            self._role[rec] = _HOST

    def roles_at(self, index: int) -> dict[str, int]:
        """Bytes by role of the device storages alive at timeline entry ``index``."""
        totals = [0] * len(ROLES)
        for born, died, nbytes, role in zip(
            self._born, self._died, self._bytes, self._role, strict=True
        ):
            if role != _HOST and born <= index < died:
                totals[role] += nbytes
        return dict(zip(ROLES, totals, strict=True))
