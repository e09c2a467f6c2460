"""Bit-packing: exact sizes and lossless round trips for every width, any length, any stride."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcomp.compressors.bitpack import pack, packed_size, unpack


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 300), seed=st.integers(0, 2**31))
def test_round_trip_is_lossless_and_exactly_sized(bits: int, n: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=generator)
    packed = pack(codes, bits)
    assert packed.numel() == (n * bits + 7) // 8 == packed_size(n, bits)
    assert torch.equal(unpack(packed, bits, n), codes)


@settings(deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 100))
def test_strided_codes_pack_like_contiguous_ones(bits: int, n: int) -> None:
    codes = torch.randint(0, 2**bits, (n * 4,), dtype=torch.uint8)
    strided = codes[::4]
    assert torch.equal(pack(strided, bits), pack(strided.contiguous(), bits))


def test_layout_of_known_values() -> None:
    # 4-bit, planar: byte j holds codes j (low nibble) and j + n/2 (high nibble).
    assert pack(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.uint8), 4).tolist() == [0x51, 0x62, 0x73, 0x84]
    # 1-bit: first code in the lowest bit.
    assert pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [0x81]
    # a short tail is one little-endian bit string: 3-bit codes 5, 6 -> 0b110_101
    assert pack(torch.tensor([5, 6], dtype=torch.uint8), 3).tolist() == [0b110101]


def test_unpack_refuses_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 7)
    with pytest.raises(ValueError, match=r"bits must be in 1\.\.8"):
        pack(torch.zeros(8, dtype=torch.uint8), 9)
