"""Counter-based noise (``gradcomp.compressors.counter``): the hash is SplitMix64's, its bits are uniform
and independent between positions, draws and keys (scipy's chi-square and Kolmogorov-Smirnov tests),
a part draws each tensor's noise in operators that do not grow with its tensors, and a checkpoint of
the counts continues the same noise."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from gradcomp.compressors import Segments, make_compressor
from gradcomp.compressors import counter as counters
from gradcomp.compressors.affine import noise, words
from gradcomp.compressors.counter import Counters
from gradcomp.workspace import Workspace

SHAPES = [torch.Size(s) for s in [(300,), (64, 70), (5,), (2048,), (3, 1000)]]


def segments(shapes: list[torch.Size]) -> Segments:
    offsets = [0]
    for shape in shapes[:-1]:
        offsets.append(offsets[-1] + math.prod(shape))
    return Segments(tuple(offsets), tuple(shapes), tuple(range(len(shapes))))


def test_the_hash_is_splitmix64() -> None:
    """SplitMix64 seeded 0 (its generator: the hash of k * GOLDEN) starts 0xE220A8397B1DCDAF,
    0x6E789E6AA1B965F4 (the published sequence), and the tensor form is bitwise the integer one."""
    assert counters.mix_int(counters.GOLDEN) % 2**64 == 0xE220A8397B1DCDAF
    assert counters.mix_int(2 * counters.GOLDEN) % 2**64 == 0x6E789E6AA1B965F4
    values = torch.randint(-(2**63), 2**63 - 1, (1000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    hashed = counters.mix_(values.clone(), torch.empty_like(values))
    assert hashed.tolist() == [counters.mix_int(int(v)) for v in values]


def _noise(first: int, chunks: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    firsts = torch.arange(chunks, dtype=torch.int64).mul_(counters.signed(counters.GOLDEN * (words(chunk) + 1)))
    drawn = noise(firsts.add_(first), chunk, Workspace())
    return drawn.offsets.clone(), drawn.bytes.reshape(-1).clone()


def test_bytes_and_offsets_are_uniform() -> None:
    """Chi-square of 400k bytes over 256 values, Kolmogorov-Smirnov of 400 offsets against U[0, 1)
    (fixed counters: deterministic, so the thresholds are not a flake's)."""
    offsets, noise_bytes = _noise(counters.stream_start(7, "w"), 400, 1000)
    assert stats.chisquare(torch.bincount(noise_bytes.long(), minlength=256).numpy()).pvalue > 1e-3
    assert stats.kstest(offsets.numpy(), "uniform").pvalue > 1e-3
    assert ((offsets >= 0) & (offsets < 1)).all()


def test_draws_and_keys_are_independent() -> None:
    """A key's next draw and another key's draw: pairs of bytes at the same position are uniform
    over the 65,536 pairs (chi-square), so neither repeats nor shadows the other."""
    chunk, count = 1024, 200
    start = counters.stream_start(3, 0)
    _, first = _noise(counters.counter(start, 0), count, chunk)
    _, second = _noise(counters.counter(start, 1), count, chunk)
    _, other = _noise(counters.counter(counters.stream_start(3, 1), 0), count, chunk)
    for a, b in ((first, second), (first, other)):
        pairs = torch.bincount(a.long() * 256 + b.long(), minlength=256 * 256).numpy()
        assert stats.chisquare(pairs).pvalue > 1e-3
        assert not torch.equal(a, b)


def test_the_bits_are_a_function_of_seed_key_draw_position() -> None:
    """Two compressors with one seed and rank round alike; another rank or seed rounds otherwise;
    the same tensor keyed alike draws the same noise whatever was compressed before it."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))

    def codes(seed: int, rank: int, before: list[str]) -> torch.Tensor:
        compressor = make_compressor("quantize:bits=2,chunk=100", seed=seed, rank=rank)
        for key in before:
            compressor.compress(torch.randn(700), key=key)
        return compressor.compress(x, key="x")[0][0]

    assert torch.equal(codes(0, 0, []), codes(0, 0, ["a", "b"]))
    assert not torch.equal(codes(0, 0, []), codes(0, 1, []))
    assert not torch.equal(codes(0, 0, []), codes(1, 0, []))


def test_a_part_whose_tensors_are_at_different_draws_is_each_tensors_own() -> None:
    """A tensor compressed alone once before (a warm-up, a regrouped bucket) is a draw ahead of the
    others in the part: its rows take its own draw, bitwise what it sends alone."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    by_rows, per_tensor = make_compressor("quantize:bits=3,chunk=64"), make_compressor("quantize:bits=3,chunk=64")
    for compressor in (by_rows, per_tensor):
        compressor.compress(torch.randn(2048), key=3)  # key 3 drawn once already
    out_rows, out_tensors = torch.empty(numel), torch.empty(numel)
    sent = by_rows.compress_part(buffer.clone(), part, 2.0)
    by_rows.decompress_part([p for p, _ in sent], [c for _, c in sent], out_rows, part)
    for view, shape, key, out in zip(part.views(buffer.clone()), part.shapes, part.keys, part.views(out_tensors),
                                     strict=True):  # fmt: skip
        payload, ctx = per_tensor.compress_divided(view.reshape(shape), 2.0, key)
        per_tensor.decompress(payload, ctx, out=out)
    assert torch.equal(out_rows, out_tensors)


def test_counts_checkpoint_and_resume() -> None:
    """A compressor restored from another's state draws on where it stopped, bitwise; a state of
    torch.Generator streams (before counters) or of another seed is refused, saying why."""
    x = torch.randn(3000)
    ran, resumed = make_compressor("qsgd:bits=4", seed=5), make_compressor("qsgd:bits=4", seed=5)
    for _ in range(3):
        ran.compress(x, key="k")
    resumed.load_state_dict(ran.state_dict())
    assert torch.equal(ran.compress(x, key="k")[0][0], resumed.compress(x, key="k")[0][0])
    fresh = Counters(1)
    with pytest.raises(ValueError, match=r"torch\.Generator states"):
        fresh.load_state_dict({"seed": 1, "streams": []})
    with pytest.raises(ValueError, match="seed 2"):
        fresh.load_state_dict({"seed": 2, "counts": []})


def test_the_element_wise_forms_are_the_in_place_ones() -> None:
    """``mix`` (what a fused kernel inlines) is ``mix_``; ``uniform_of`` is ``uniform``, and both
    are exact: each word's top 53 bits, never 1.0 (an int64 times a float rounds in float32)."""
    values = torch.randint(-(2**63), 2**63 - 1, (1000,), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    values[0] = -1  # all 53 bits set: float32 would round it to 1.0
    assert torch.equal(counters.mix(values), counters.mix_(values.clone(), torch.empty_like(values)))
    exact = torch.tensor([((int(v) % 2**64) >> 11) / 2**53 for v in values], dtype=torch.float64)
    assert torch.equal(counters.uniform_of(values), exact)
    assert torch.equal(counters.uniform(values.clone(), torch.empty(1000, dtype=torch.float64)), exact)
    assert exact.max() < 1
