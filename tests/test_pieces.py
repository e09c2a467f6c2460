"""Pieces (HookSpec.pieces): large tensors compressed as pieces of their rows, the step's last bucket
sent in parts; bitwise the whole tensors' training for deterministic compressors, on gloo ranks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from gradcomp.engine import pieces
from gradcomp.engine.spec import HookSpec
from tests.distributed import Failures, parameters_identical_on_all_ranks, run_checks
from tests.test_hooks import resume
from tests.toy_ddp import train


@pytest.mark.parametrize("shape", [(2048, 1024), (1000, 1003), (4096,), (3, 1 << 20), (1 << 21,)])
@pytest.mark.parametrize("count", [2, 3, 4, 7])
@pytest.mark.parametrize("multiple", [1, 512, 1024])
def test_cut_covers_the_tensor_in_row_pieces_at_multiples_of_the_chunk(
    shape: tuple[int, ...], count: int, multiple: int
) -> None:
    keys, shapes = pieces.cut(["w"], [torch.Size(shape)], count, multiple)
    assert sum(math.prod(s) for s in shapes) == math.prod(shape)
    assert all(s[1:] == shape[1:] for s in shapes), "pieces are rows: the other dimensions stay"
    assert len(shapes) <= count
    if len(shapes) == 1:
        assert keys == ["w"] and shapes == [torch.Size(shape)], "a tensor left whole keeps its key"
        return
    assert keys == [("w", "piece", i) for i in range(len(shapes))]
    assert all(math.prod(s) % multiple == 0 for s in shapes[:-1])
    assert all(math.prod(s) >= pieces.PIECE_MIN for s in shapes[:-1])


def test_small_tensors_and_small_pieces_stay_whole() -> None:
    small = [torch.Size((512, 512)), torch.Size((10,)), torch.Size(())]
    assert pieces.cut([0, 1, 2], small, 4, 1) == ([0, 1, 2], small)
    big = torch.Size((2048, 1024))  # four pieces of 512K, but min_numel asks for 1M each
    assert len(pieces.cut([0], [big], 4, 1, smallest=1 << 20)[1]) == 2


@pytest.mark.parametrize(
    "sizes", [[524288] * 4 + [2048], [10, 2048, 4194304, 2048], [5, 5, 5], [7], [1] * 8, [3, 100, 3, 100, 3]]
)
@pytest.mark.parametrize("count", [2, 3, 4])
def test_parts_are_consecutive_groups_of_about_the_same_size(sizes: list[int], count: int) -> None:
    groups = pieces.parts(sizes, count)
    assert [i for g in groups for i in g] == list(range(len(sizes))), "every tensor once, in order"
    assert all(len(g) for g in groups) and len(groups) <= count
    assert len(groups) == min(count, len(sizes)) or max(sizes) * 2 > sum(sizes)
    if sizes == [524288] * 4 + [2048] and count == 4:
        assert [len(g) for g in groups] == [1, 1, 1, 2], "four equal pieces, the small tensor with the last"


def test_spans_cut_a_whole_bucket_at_multiples() -> None:
    assert pieces.spans(3_000_000, 4, 1) == [(0, 750000), (750000, 1500000), (1500000, 2250000), (2250000, 3000000)]
    assert pieces.spans(100, 4, 1) == [(0, 100)], "parts of at least PIECE_MIN"
    cuts = pieces.spans(3_000_001, 3, 1024)
    assert cuts[-1][1] == 3_000_001 and all(start % 1024 == 0 for start, _ in cuts)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topk:ratio=0.1,pieces=2", "compresses each tensor as a whole"),
        ("powersgd:rank=2,pieces=2", "compresses each tensor as a whole"),
        ("sign:ef=true,clip=1.0,pieces=2", "clip takes a tensor's norm"),
        ("noop:pieces=2", "nothing to cut"),
        ("sign:pieces=0", "integer >= 1"),
        ("sign:pieces=two", "must be an integer"),
    ],
)
def test_pieces_is_refused_where_pieces_would_compress_otherwise(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HookSpec.parse(spec)


def test_pieces_is_part_of_the_canonical_spec() -> None:
    spec = HookSpec.parse("sign:ef=true,pieces=4")
    assert spec.pieces == 4 and HookSpec.parse(str(spec)) == spec
    assert "pieces" not in str(HookSpec.parse("sign:ef=true,pieces=1"))


@contextlib.contextmanager
def small_pieces(least: int) -> Iterator[None]:
    """Pieces of the toy model's matrices (64 x 64): ranks are pooled, so the default comes back."""
    default = pieces.PIECE_MIN
    pieces.PIECE_MIN = least
    try:
        yield
    finally:
        pieces.PIECE_MIN = default


SPECS = ["sign:ef=true", "fp16", "quantize:bits=4,rounding=nearest,ef=true,momentum=0.9", "fp8:ef=true,chunk=256"]


def pieces_against_whole(rank: int, world: int) -> Failures:
    failures = Failures()
    with small_pieces(256):
        for spec in SPECS:
            whole, whole_state = train(rank, spec, 6, bucket_cap_mb=0.02)
            pieced, state = train(rank, f"{spec}{',' if ':' in spec else ':'}pieces=4", 6, bucket_cap_mb=0.02)
            assert whole_state is not None and state is not None and state.engine is not None
            failures.expect(
                all(torch.equal(a, b) for a, b in zip(whole, pieced, strict=True)),
                f"{spec}: pieces train otherwise than whole tensors",
            )
            failures.expect(parameters_identical_on_all_ranks(pieced), f"{spec}: ranks differ with pieces")
            mine, theirs = state.steps()[-1], whole_state.steps()[-1]
            failures.expect(mine.buckets == theirs.buckets, f"{spec}: buckets {mine.buckets} against {theirs.buckets}")
            failures.expect(mine.input_bytes == theirs.input_bytes, f"{spec}: input bytes differ")
            last = [r for r in state.engine.records if r.step == mine.step and r.bucket == max(
                r.bucket for r in state.engine.records if r.step == mine.step)]  # fmt: skip
            failures.expect(
                sorted(r.part for r in last) == list(range(len(last))) and len(last) > 1,
                f"{spec}: the last bucket went in parts {[r.part for r in last]}",
            )
    return failures


def test_pieces_train_bitwise_as_whole_tensors_with_the_last_bucket_in_parts() -> None:
    run_checks(2, pieces_against_whole, timeout=240)


def resume_in_pieces(rank: int, world: int, spec: str) -> Failures:
    with small_pieces(256):
        return resume(rank, world, spec)


@pytest.mark.parametrize("spec", ["sign:ef=true,pieces=3", "quantize:bits=2,ef=true,momentum=0.9,pieces=4"])
def test_checkpoint_and_resume_continue_exactly_in_pieces(spec: str) -> None:
    run_checks(2, resume_in_pieces, (spec,), timeout=240)
