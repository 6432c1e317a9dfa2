"""parse_bytes at its edges: every size it refuses raises ValueError naming the value and what
is accepted, a type it cannot take raises TypeError, and fractions of a byte round down."""

from __future__ import annotations

import pytest

from solvers.core.units import MAX_BYTES, parse_bytes


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        float("-inf"),
        "1e400 GiB",  # overflows a float
        "1e999999999 GiB",  # an exponent too large to expand cheaply
        2**63,
        "9223372036854775808",
        "8388608 TiB",  # 2**63 bytes
        10**400,
        True,
        False,
        0.4,  # rounds down to 0 bytes
        "0.5 B",
        "1e-999999999 GiB",
        -1,
    ],
)
def test_refused_sizes_name_the_value_and_the_range(value):
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    message = str(info.value)
    assert repr(value) in message and "from 1 to 2**63 - 1" in message


@pytest.mark.parametrize("value", [[1], b"40GiB", object(), 1j])
def test_other_types_are_a_type_error(value):
    with pytest.raises(TypeError, match="memory size"):
        parse_bytes(value)


def test_none_means_no_budget():
    assert parse_bytes(None) is None


def test_the_largest_size_is_accepted():
    assert MAX_BYTES == 2**63 - 1
    assert parse_bytes(MAX_BYTES) == parse_bytes("9223372036854775807") == MAX_BYTES
    assert parse_bytes("8388607.999 TiB") < MAX_BYTES


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2.01 KB", 2010),  # read in decimal: in binary floating point 2.01 * 1000 falls just below
        ("2.01 GB", 2_010_000_000),
        ("0.3 KB", 300),
        ("1.5 B", 1),  # a fraction of a byte rounds down
        (1023.9, 1023),
        (1.5e9, 1_500_000_000),
        ("1e3 KiB", 1000 * 1024),
    ],
)
def test_whole_bytes_round_down_from_an_exact_decimal(value, expected):
    assert parse_bytes(value) == expected
