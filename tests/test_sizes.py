"""Top-k and random-k by size groups (``gradcomp.compressors.sizes``, ``feedback/sizes.py``): a
part's tensors of one size selected as the rows of one matrix give bitwise what each gives alone
(sums over ranks, error feedback's residuals and velocities, a non-finite step, a warm-up's ratio,
half precision), and the operators per part grow with its sizes, not its tensors."""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp.bench.launches import compare, gpt_shapes
from gradcomp.compressors import Compressor, Segments, make_compressor
from gradcomp.compressors.sizes import AloneMeta, GroupMeta, SizeGroups

pytestmark = pytest.mark.usefixtures("both_paths")  # the CPU's paths, and an accelerator's (no host read)

SHAPES = [torch.Size(s) for s in [(40, 30), (30,), (0,), (7,), (30,), (64, 16), (1200,), (300, 300), (30,), (1, 7)]]
"""Sizes shared and not, an empty tensor, one larger than top-k batches (90,000 > 65,536)."""


def segments(shapes: list[torch.Size]) -> Segments:
    offsets = [5]  # the part starts inside its buffer
    for shape in shapes[:-1]:
        offsets.append(offsets[-1] + math.prod(shape))
    return Segments(tuple(offsets), tuple(shapes), tuple(f"p{i}" for i in range(len(shapes))))


def _steps(spec: str, per_tensor: bool, dtype: torch.dtype = torch.float32, ratio: float | None = None,
           steps: int = 3) -> tuple[list[torch.Tensor], Compressor]:  # fmt: skip
    """Each step's sum of two ranks' payloads (the same rank's twice, as in the engine's sums) through
    the part's calls, by size groups or the base class's tensor by tensor; a NaN at the last step."""
    part = segments(SHAPES)
    numel = part.offsets[-1] + math.prod(SHAPES[-1])
    compressor = make_compressor(spec, seed=1)
    owner = Compressor if per_tensor else type(compressor)
    generator = torch.Generator().manual_seed(4)
    outputs = []
    for step in range(steps):
        x = torch.randn(numel, generator=generator).to(dtype)
        if step == steps - 1:
            x[part.offsets[1] + 3] = float("nan")  # the first (30,) tensor's step is not finite
        options = {} if ratio is None else {"ratio": ratio}
        states = owner.compress_part(compressor, x.clone(), part, 2.0, **options)  # type: ignore[attr-defined]
        out = torch.zeros(numel, dtype=dtype)
        owner.decompress_sum_part(compressor, [[p, p] for p, _ in states], [c for _, c in states], out, part)  # type: ignore[attr-defined]
        outputs.append(out)
    return outputs, compressor


@pytest.mark.parametrize(
    "spec",
    ["topk:ratio=0.1", "topk:ratio=0.1,ef=true", "topk:ratio=0.02,ef=true", "randomk:ratio=0.05,scale=false,ef=true",
     "topk:ratio=0.1,method=sampled", "topk:ratio=0.02,method=sampled,ef=true"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_size_groups_give_each_tensors_own_result(spec: str, dtype: torch.dtype) -> None:
    ours, grouped = _steps(spec, per_tensor=False, dtype=dtype)
    theirs, alone = _steps(spec, per_tensor=True, dtype=dtype)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert torch.isnan(ours[-1]).any()  # the NaN travelled, as a tensor alone sends it
    if "ef=true" in spec:
        mine, yours = grouped.residuals, alone.residuals  # type: ignore[attr-defined]
        assert mine.keys() == yours.keys() and all(torch.equal(mine[k], yours[k]) for k in yours)
        assert torch.isfinite(mine["p1"]).all()  # the bad step kept the residual as it was


def test_a_warmup_ratio_keeps_each_tensors_k() -> None:
    ours, _ = _steps("topk:ratio=0.01,ef=true", per_tensor=False, ratio=0.3, steps=2)
    theirs, _ = _steps("topk:ratio=0.01,ef=true", per_tensor=True, ratio=0.3, steps=2)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(ours, theirs, strict=True))


def test_the_groups_hold_every_tensor_once() -> None:
    part = segments(SHAPES)
    groups = SizeGroups.of(part, 65536)
    members = sorted([i for g in groups.groups for i in g.members] + list(groups.alone))
    assert members == list(range(len(SHAPES))) and groups.alone == (7,)
    assert [g.numel for g in groups.groups] == [1200, 30, 0, 7, 1024]  # by first appearance, 1200 twice
    compressor = make_compressor("topk:ratio=0.1")
    states = compressor.compress_part(torch.randn(part.offsets[-1] + 7), part, 1.0)
    assert [type(c) for _, c in states] == [GroupMeta] * 5 + [AloneMeta]
    assert make_compressor("topk:ratio=0.1,method=sampled").largest_batched == 65536  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.01,ef=true",
                                  "topk:ratio=0.01,method=sampled,ef=true"])  # fmt: skip
def test_operators_grow_with_sizes_not_tensors(spec: str) -> None:
    """150 GPT-shaped tensors in 9 sizes cost what 9 tensors of those sizes cost."""
    shapes = gpt_shapes()
    one_each = list({math.prod(s): s for s in shapes}.values())
    _, many = compare(spec, shapes)
    _, few = compare(spec, one_each)
    assert many.tensors == 150 and few.tensors == len(one_each) == 9
    assert (many.compress, many.decompress) == (few.compress, few.decompress), (many, few)


@pytest.mark.parametrize(
    "spec",
    ["topk:ratio=0.1,ef=true,momentum=0.9,nesterov=true", "topk:ratio=0.05,ef=true,momentum=0.9,mask=true",
     "topk:ratio=0.05,method=sampled,ef=true,momentum=0.9,mask=true"],
)  # fmt: skip
def test_momentum_correction_by_size_keeps_each_tensors_velocity(spec: str) -> None:
    """DGC's configuration (top-k, momentum correction, masking): sums, residuals and velocities
    bitwise tensor by tensor, a NaN step keeping that tensor's velocity."""
    ours, grouped = _steps(spec, per_tensor=False)
    theirs, alone = _steps(spec, per_tensor=True)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    for states in ("residuals", "velocities"):
        mine, yours = getattr(grouped, states), getattr(alone, states)
        assert mine.keys() == yours.keys() and all(torch.equal(mine[k], yours[k]) for k in yours), states
    assert torch.isfinite(grouped.velocities["p1"]).all()  # type: ignore[attr-defined]
    part = segments(SHAPES)
    states = grouped.compress_part(torch.randn(part.offsets[-1] + 7), part, 2.0)
    assert any(isinstance(c, GroupMeta) for _, c in states)  # by size groups indeed


@pytest.mark.parametrize("spec", ["randomk:ratio=0.1", "randomk:ratio=0.05,scale=false"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_k_by_size_draws_each_tensors_own_indices(spec: str, dtype: torch.dtype) -> None:
    """Random-k's indices come from counters (seed, key, draw, block): a part's tensors of one size
    drawn as rows give bitwise what each gives alone, its sums over ranks too (a NaN step included)."""
    ours, _ = _steps(spec, per_tensor=False, dtype=dtype)
    theirs, _ = _steps(spec, per_tensor=True, dtype=dtype)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    part = segments(SHAPES)
    states = make_compressor(spec).compress_part(torch.randn(part.offsets[-1] + 7), part, 2.0)
    assert sum(not isinstance(c, AloneMeta) for _, c in states) == 5  # five sizes, the largest tensor alone


def test_random_k_refuses_a_checkpoint_of_generator_states() -> None:
    with pytest.raises(ValueError, match=r"holds torch\.Generator states"):
        make_compressor("randomk:ratio=0.1").load_state_dict({"shared": {}})
    a, b = make_compressor("randomk:ratio=0.1"), make_compressor("randomk:ratio=0.1")
    x = torch.randn(1000)
    a.compress(x, key="w")
    b.load_state_dict(a.state_dict())  # the counts: the next draw is the same
    assert torch.equal(a.compress(x, key="w")[0][0], b.compress(x, key="w")[0][0])


def test_random_k_by_size_decodes_a_sum_as_each_tensor_alone() -> None:
    """The engine decodes a random-k part from the all-reduced payloads (``decompress_part``): each
    tensor bitwise its own ``decompress``, a sent -0.0 included."""
    part = segments(SHAPES)
    x = torch.randn(part.offsets[-1] + 7, generator=torch.Generator().manual_seed(9))
    x[part.offsets[1] : part.offsets[1] + 30] = -0.0
    ours, theirs = make_compressor("randomk:ratio=0.2,scale=false"), make_compressor("randomk:ratio=0.2,scale=false")
    mine, yours = torch.full_like(x, 5.0), torch.full_like(x, 5.0)
    states = ours.compress_part(x.clone(), part, 1.0)
    ours.decompress_part([p for p, _ in states], [c for _, c in states], mine, part)
    states = Compressor.compress_part(theirs, x.clone(), part, 1.0)
    Compressor.decompress_part(theirs, [p for p, _ in states], [c for _, c in states], yours, part)
    assert torch.equal(mine.view(torch.int32), yours.view(torch.int32))


@pytest.mark.parametrize("spec", ["topk:ratio=0.05,method=sampled", "topk:ratio=0.05,method=sampled,ef=true",
                                  "topk:ratio=0.05,method=sampled,ef=true,momentum=0.9,mask=true"])  # fmt: skip
def test_a_measured_part_goes_by_size_groups_as_the_part_at_once(spec: str) -> None:
    """The accelerator's path for sampled top-k: a part measured on one thread (backward's), one
    record per size group (its payload's rows) and one per tensor alone, then compressed at the
    counts on another (the executor's), sends and keeps what compressing it at once does, over
    three steps, the last with a NaN."""
    import concurrent.futures

    part = segments(SHAPES)
    numel = part.offsets[-1] + math.prod(SHAPES[-1])
    at_once, measured = make_compressor(spec, seed=1), make_compressor(spec, seed=1)
    generator = torch.Generator().manual_seed(4)
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        for step in range(3):
            x = torch.randn(numel, generator=generator)
            if step == 2:
                x[part.offsets[1] + 3] = float("nan")
            expected = at_once.compress_part(x.clone(), part, 2.0)
            records = measured.measure_part(x.clone(), part, 2.0)
            assert [r.rows for r in records] == [2, 3, 1, 2, 1, None]  # 5 size groups, then (300, 300) alone
            counts = [int(r.count) for r in records]
            states = executor.submit(measured.compress_measured_part, records, counts, part).result()
            assert [type(c) for _, c in states] == [type(c) for _, c in expected]
            for (payload, _), (theirs, _), record, count in zip(states, expected, records, counts, strict=True):
                assert all(t.shape == record.shape(measured.payload_length(count, record)) for t in payload)
                pairs = zip(payload, theirs, strict=True)
                assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in pairs)
    if "ef=true" in spec:
        for states in ("residuals", "velocities"):
            mine, yours = getattr(measured, states), getattr(at_once, states)
            assert mine.keys() == yours.keys() and all(torch.equal(mine[k], yours[k]) for k in yours), states
