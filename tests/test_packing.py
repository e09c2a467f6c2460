"""Packing many tensors into one byte buffer (a bucket's payloads in one collective): exact sizes,
8-byte alignment, and bitwise round trips for every dtype, size and trailing shape."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcomp.engine.packing import ALIGN, aligned, header, pack, packed_bytes, shapes, unpack

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.uint8,
]


def _tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(0, 100, (numel,), generator=generator).to(dtype)


@settings(max_examples=100, deadline=None)
@given(
    layout=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 40)), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
)
def test_round_trip_is_bitwise_and_exactly_sized(layout: list[tuple[torch.dtype, int]], seed: int) -> None:
    tensors = [_tensor(dtype, numel, seed + i) for i, (dtype, numel) in enumerate(layout)]
    raw = pack(tensors, torch.device("cpu"))
    assert raw.dtype == torch.uint8 and raw.numel() == packed_bytes([t.shape for t in tensors], tensors)
    assert raw.numel() == sum(aligned(t.numel() * t.element_size()) for t in tensors)
    back = unpack(raw, shapes(header(tensors), tensors), tensors)
    offset = 0
    for original, restored in zip(tensors, back, strict=True):
        assert restored.dtype == original.dtype and torch.equal(restored, original)
        assert offset % ALIGN == 0  # each tensor starts where it can be viewed as its dtype
        offset += aligned(original.numel() * original.element_size())


def test_the_receiver_unpacks_other_shapes_with_its_own_dtypes() -> None:
    """A sparse payload's length, or a per-chunk scale's number of chunks (a (2, chunks) tensor), differs
    between ranks and shards: the header carries every shape, the receiver's own payload the dtypes."""
    senders = [torch.arange(6, dtype=torch.int16).view(2, 3), torch.linspace(0, 1, 5), torch.zeros(2, 0)]
    receivers = [torch.zeros(2, 1, dtype=torch.int16), torch.zeros(1), torch.zeros(2, 4)]
    received = header(senders)
    assert received == [2, 3, 5, 2, 0]
    back = unpack(pack(senders, torch.device("cpu")), shapes(received, receivers), receivers)
    assert [b.shape for b in back] == [s.shape for s in senders]
    assert all(b.dtype == s.dtype and torch.equal(b, s) for b, s in zip(back, senders, strict=True))
    with pytest.raises(ValueError, match="does not describe"):
        shapes(received[:-1], receivers)


def test_nothing_and_non_contiguous_tensors() -> None:
    empty = pack([], torch.device("cpu"))
    assert empty.dtype == torch.uint8 and empty.numel() == 0
    column = torch.arange(12, dtype=torch.float32).view(3, 4)[:, 1]
    assert torch.equal(unpack(pack([column], torch.device("cpu")), [(3,)], [column])[0], column)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 16])
def test_alignment(nbytes: int) -> None:
    assert aligned(nbytes) % ALIGN == 0 and nbytes <= aligned(nbytes) < nbytes + ALIGN
