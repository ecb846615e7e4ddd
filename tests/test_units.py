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
