"""The storage ledger's arithmetic on a hand-made timeline: which bytes are alive at an index,
the role precedence, a storage that dies, a reused key, and offloaded (host) storages left out
of the device breakdown."""

from __future__ import annotations

from trials.roles import ROLES, StorageLedger


def _zero(**bytes_by_role: int) -> dict[str, int]:
    return {role: bytes_by_role.get(role, 0) for role in ROLES}


def test_bytes_alive_at_each_index_by_role() -> None:
    ledger = StorageLedger()
    ledger.born(1, 0, 100)  # a weight, alive throughout
    ledger.tag(1, "parameters")
    ledger.born(2, 1, 30)  # an activation, freed at 3
    ledger.tag(2, "activations")
    ledger.born(3, 2, 7)  # untagged: other
    ledger.died(2, 3)
    assert ledger.roles_at(0) == _zero(parameters=100)
    assert ledger.roles_at(1) == _zero(parameters=100, activations=30)
    assert ledger.roles_at(2) == _zero(parameters=100, activations=30, other=7)
    assert ledger.roles_at(3) == _zero(parameters=100, other=7)  # dead from its death index


def test_the_earlier_role_wins_and_a_dead_key_takes_no_tag() -> None:
    ledger = StorageLedger()
    ledger.born(1, 0, 64)
    ledger.tag(1, "parameters")
    ledger.tag(1, "activations")  # autograd saves a weight: it stays a parameter
    ledger.born(2, 0, 8)
    ledger.tag(2, "activations")
    ledger.tag(2, "gradients")  # a role earlier in ROLES replaces a later one
    ledger.died(2, 1)
    ledger.tag(2, "optimizer_states")  # dead: ignored
    assert ledger.roles_at(0) == _zero(parameters=64, gradients=8)
    assert ledger.roles_at(1) == _zero(parameters=64)


def test_a_reused_key_is_a_new_storage() -> None:
    ledger = StorageLedger()
    ledger.born(5, 0, 10)
    ledger.tag(5, "gradients")
    ledger.died(5, 2)
    ledger.born(5, 2, 40)  # the allocator hands the same address out again
    assert ledger.roles_at(1) == _zero(gradients=10)
    assert ledger.roles_at(2) == _zero(other=40)


def test_host_storages_are_not_device_bytes() -> None:
    ledger = StorageLedger()
    ledger.born(1, 0, 100)
    ledger.born(2, 0, 50)
    ledger.host(2)  # offloaded optimizer partition
    ledger.tag(2, "optimizer_states")  # a host storage keeps out of every role
    ledger.host(99)  # never seen: nothing happens
    assert ledger.roles_at(0) == _zero(other=100)
    ledger.died(2, 1)
    ledger.born(2, 1, 20)  # the key reused on the device counts again
    assert ledger.roles_at(1) == _zero(other=120)


def test_a_death_the_ledger_never_saw_born_is_ignored() -> None:
    """A storage made before tracking began (or already dead) may be freed while it runs: its
    death changes nothing, and the ledger goes on."""
    ledger = StorageLedger()
    ledger.born(1, 0, 10)
    ledger.died(99, 1)  # never born here
    ledger.died(1, 2)
    ledger.died(1, 3)  # twice
    assert ledger.roles_at(1) == _zero(other=10)
    assert ledger.roles_at(2) == _zero()
