import pytest

from autotune.errors import UserError
from autotune.units import budget_label, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("24gb", 24 * 10**9),
        ("300mib", 300 * 2**20),
        ("2048KiB", 2048 * 1024),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "-1GB", "0", "GB", "0GB", "", "24", "1e3GB", "twoGB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UserError):
        parse_size(text)


def test_format_and_label() -> None:
    assert format_size(1.5 * 2**30) == "1.5 GiB"
    assert format_size(300 * 2**20) == "300 MiB"
    assert format_size(512) == "512 B"
    assert format_size(1013 * 2**20) == "1013 MiB"
    assert budget_label("24gib") == "24GiB"
    assert budget_label("300mb") == "300MB"


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # SI units are powers of 10, IEC units powers of 2 (IEC 80000-13), worked out by hand
        ("2000KB", 2_000_000),
        ("2000kb", 2_000_000),
        ("2MB", 2_000_000),
        ("1TB", 1_000_000_000_000),
        ("1024KiB", 1_048_576),
        ("1MiB", 1_048_576),
        ("1GiB", 1_073_741_824),
        ("1TiB", 1_099_511_627_776),
        ("1048576B", 1_048_576),
        (" 2.5 GB ", 2_500_000_000),
        ("+3MB", 3_000_000),
        (".5GiB", 536_870_912),
    ],
)
def test_units_are_si_or_iec_by_name(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (1023 * 2**20, "1023 MiB"),
        (999 * 2**20, "999 MiB"),
        (2**30, "1 GiB"),
        (5 * 2**40, "5 TiB"),
        (3 * 2**50, "3072 TiB"),
        (None, "-"),
    ],
)
def test_format_size_by_hand(n: float | None, expected: str) -> None:
    assert format_size(n) == expected


def test_budget_bounds_and_their_messages() -> None:
    """One PiB is the largest budget and one MiB the smallest, both inclusive; each refusal
    says which rule it broke (the messages a user sees, exactly)."""
    assert parse_size("1024TiB") == 2**50
    assert parse_size("1MiB") == 2**20
    with pytest.raises(UserError) as too_big:
        parse_size("1125899906842625B")  # 2**50 + 1
    assert str(too_big.value) == (
        "invalid budget '1125899906842625B': more than 1024 TiB per device"
    )
    with pytest.raises(UserError) as zero:
        parse_size("0GB")
    assert str(zero.value) == "invalid budget '0GB': it must be greater than zero"
    with pytest.raises(UserError) as small:
        parse_size("0.5B")  # positive, but under the smallest budget
    assert str(small.value) == "invalid budget '0.5B': under 1 MiB, no model trains in it"
    with pytest.raises(UserError) as unitless:
        parse_size("24")
    assert str(unitless.value) == (
        "invalid budget '24': use a number and a unit, e.g. 24GB, 24GiB, 500MB, 1.5GiB"
    )


def test_format_size_whole_bytes_and_four_digit_values() -> None:
    assert format_size(5.7) == "5 B"  # bytes are whole
    assert format_size(1000 * 1024) == "1000 KiB"  # four digits, never 1e+03
    assert format_size(999.4 * 1024) == "999 KiB"
