"""Sizes on the command line: one syntax, elements or bytes, never a guess."""

from __future__ import annotations

import pytest

from gradcomp.bench.units import (
    Size,
    format_bytes,
    format_elements,
    parse_bandwidth,
    parse_duration,
    parse_size,
    parse_sizes,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1M", Size(10**6, "elements")),
        ("25m", Size(25 * 10**6, "elements")),
        ("4096", Size(4096, "elements")),
        ("1.5K", Size(1500, "elements")),
        ("4KiB", Size(4096, "bytes")),
        ("16MiB", Size(16 * 2**20, "bytes")),
        ("100MB", Size(10**8, "bytes")),
        ("12B", Size(12, "bytes")),
    ],
)
def test_sizes_say_elements_or_bytes(text: str, size: Size) -> None:
    assert parse_size(text) == size


def test_elements_and_bytes_convert_through_float32() -> None:
    assert parse_size("1K").as_bytes() == 4000 and parse_size("1K").as_elements() == 1000
    assert parse_size("4KiB").as_elements() == 1024 and parse_size("4KiB").as_bytes() == 4096
    with pytest.raises(ValueError, match="not a whole number of 4-byte elements"):
        parse_size("6B").as_elements()


@pytest.mark.parametrize("text", ["lots", "-3", "2Q", "4Mi", "4mib", "4 MiBs", ""])
def test_ambiguous_and_malformed_sizes_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="N, NK, NM, NG \\(elements\\) or NB"):
        parse_size(text)


def test_fractions_of_an_element_are_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number of elements"):
        parse_size("1.5")


def test_lists_and_their_formatting_round_trip() -> None:
    assert parse_sizes("1M, 4KiB") == [Size(10**6, "elements"), Size(4096, "bytes")]
    with pytest.raises(ValueError, match="no sizes"):
        parse_sizes(" , ")
    assert parse_size(format_elements(25_000_000)) == Size(25_000_000, "elements")
    assert parse_size(format_bytes(16 * 2**20).replace(" ", "")) == Size(16 * 2**20, "bytes")
    assert format_bytes(1000) == "1000 B" and format_elements(1234) == "1234"


def test_bandwidths_in_bits_or_bytes_and_durations() -> None:
    assert parse_bandwidth("25gbit") == pytest.approx(25e9 / 8)
    assert parse_bandwidth("100mbit") == pytest.approx(12.5e6)
    assert parse_bandwidth("600GB/s") == pytest.approx(600e9)
    assert parse_bandwidth("12.5 MB/s") == pytest.approx(12.5e6)
    assert parse_duration("5us") == pytest.approx(5e-6) and parse_duration("2ms") == pytest.approx(2e-3)
    for bad in ("fast", "0gbit", "25gb", "-1mbit"):
        with pytest.raises(ValueError, match="expected a positive rate"):
            parse_bandwidth(bad)
    with pytest.raises(ValueError, match=r"expected e\.g\. 5us"):
        parse_duration("5 minutes")
