"""PowerSGD: exact on low-rank inputs, layout of flat buckets, warm start from the aggregate."""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp.compressors import Compressor, Segments, make_compressor, roundtrip, simulate
from gradcomp.compressors.powersgd import PowerSGD, batches
from gradcomp.compressors.simulate import compress_all
from tests.helpers import relative_error

pytestmark = pytest.mark.usefixtures("both_paths")  # the CPU's paths and an accelerator's


def low_rank(rows: int, cols: int, rank: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols, generator=generator)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_reconstructs_matrices_of_rank_at_most_r(rank: int) -> None:
    """Exact but for float32's roundings, which a random start with little of the matrix's row space
    amplifies (by 1 / cos of its angle): over 8 seeds, typically 1e-7, at worst 1e-4."""
    m = low_rank(64, 48, rank)
    errors = sorted(relative_error(roundtrip(make_compressor(f"powersgd:rank={rank}", seed=s), m), m) for s in range(8))
    assert errors[4] < 1e-6 and errors[-1] < 1e-4, errors


def test_aggregate_of_ranks_is_exact_when_the_sum_is_low_rank() -> None:
    left = torch.randn(64, 2)
    parts = [left @ torch.randn(2, 48, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    results = simulate([make_compressor("powersgd:rank=2", seed=9, rank=r) for r in range(3)], parts)
    assert relative_error(results[0], sum(parts)) < 1e-5
    assert all(torch.equal(r, results[0]) for r in results)


def test_flat_bucket_is_split_by_shapes() -> None:
    weight, bias, conv = low_rank(32, 20, 1), torch.randn(32), low_rank(8, 27, 1).view(8, 3, 3, 3)
    flat = torch.cat([weight.view(-1), bias, conv.view(-1)])
    compressor = PowerSGD(PowerSGD.Config(rank=1))
    shapes = [weight.shape, bias.shape, conv.shape]
    payload, _ctx = compressor.compress(flat, shapes=shapes)
    segments = compressor.layout(flat.numel(), flat.shape, shapes)
    assert [s.rank for s in segments] == [1, 0, 1]  # the vector travels uncompressed
    assert payload[0].numel() == 32 + 8 and torch.equal(payload[1], bias)
    result = roundtrip(compressor, flat, shapes=shapes)
    assert relative_error(result, flat) < 1e-5
    assert torch.equal(result[640:672], bias)  # uncompressed part is exact
    # without the shapes, a flat bucket is one vector: sent whole
    assert torch.equal(roundtrip(make_compressor("powersgd"), flat), flat)


def test_matrices_of_one_shape_at_a_constant_distance_are_one_batch() -> None:
    """A transformer's layers in a bucket: same-shape weights between their biases are one batched
    view (no copy), computed by one bmm and one batched QR; a distance that changes starts a new
    batch. The batched result is the projection every matrix gets on its own."""
    shapes = [(8, 6), (6,), (8, 6), (6,), (8, 6), (5, 5), (8, 6)]
    parts = [low_rank(*shape, 1) if len(shape) == 2 else torch.randn(shape) for shape in shapes]
    flat = torch.cat([part.reshape(-1) for part in parts])
    compressor = PowerSGD(PowerSGD.Config(rank=1))
    groups = batches(compressor.layout(flat.numel(), flat.shape, [torch.Size(s) for s in shapes]))
    assert [(g.rows, g.cols, g.count, g.stride) for g in groups] == [(8, 6, 3, 54), (5, 5, 1, 25), (8, 6, 1, 48)]
    assert groups[0].matrices(flat).data_ptr() == flat.data_ptr()  # a view
    assert torch.equal(groups[0].matrices(flat)[2], parts[4])
    result = roundtrip(compressor, flat, shapes=[torch.Size(s) for s in shapes])
    assert relative_error(result, flat) < 1e-5  # rank-1 matrices are their own projection
    for start, part in zip([0, 48, 54, 102, 108, 156, 181], parts, strict=True):
        alone = roundtrip(PowerSGD(PowerSGD.Config(rank=1)), part) if part.dim() == 2 else part
        assert torch.allclose(result[start : start + part.numel()].view(part.shape), alone, atol=1e-5)


def test_matrices_that_would_not_shrink_travel_uncompressed() -> None:
    m = torch.randn(3, 4)  # rank 2: 2 * (3 + 4) = 14 > 12 elements
    compressor = make_compressor("powersgd:rank=2")
    (p, raw), _ = compressor.compress(m)
    assert p.numel() == 0 and torch.equal(raw, m.view(-1))
    assert torch.equal(roundtrip(compressor, m), m)


def test_shapes_must_cover_the_tensor() -> None:
    with pytest.raises(ValueError, match="hold 12 elements, the tensor has 13"):
        make_compressor("powersgd").compress(torch.randn(13), shapes=[torch.Size([3, 4])])


def test_zero_and_rank_deficient_inputs_stay_finite() -> None:
    compressor = make_compressor("powersgd:rank=4")
    assert torch.equal(roundtrip(compressor, torch.zeros(20, 30)), torch.zeros(20, 30))
    m = low_rank(20, 30, 1)
    assert relative_error(roundtrip(compressor, m), m) < 1e-5


def test_warm_start_remembers_the_aggregate_not_the_local_factor() -> None:
    parts = [torch.randn(40, 30, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    compressors = [make_compressor("powersgd:rank=2", seed=1, rank=r) for r in range(2)]
    contexts, finals = compress_all(compressors, parts, key="w")
    for c, ctx in zip(compressors, contexts, strict=True):
        c.contribution(finals[0], ctx)  # error feedback's local view must not touch the memory
        assert "w" not in c.memory  # type: ignore[attr-defined]
    q_sum = finals[0][0] + finals[1][0]
    for c, ctx in zip(compressors, contexts, strict=True):
        c.decompress((q_sum.clone(),), ctx)
        assert torch.equal(c.memory["w"], q_sum)  # type: ignore[attr-defined]


def test_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    """Repeated power iterations on a fixed matrix approach its truncated SVD."""
    m = torch.randn(50, 40) + 3 * low_rank(50, 40, 1)
    compressor = make_compressor("powersgd:rank=1")
    for _ in range(30):
        approx = roundtrip(compressor, m, key="w")
    u, s, vh = torch.linalg.svd(m)
    best = s[0] * torch.outer(u[:, 0], vh[0])
    assert relative_error(approx, best) < 1e-3
    cold = make_compressor("powersgd:rank=1,warm_start=false")
    errors = [relative_error(roundtrip(cold, m, key="w"), best) for _ in range(5)]
    assert min(errors) > relative_error(approx, best)


def test_decompress_before_the_second_round_is_an_error() -> None:
    compressor = make_compressor("powersgd")
    payload, ctx = compressor.compress(torch.randn(20, 30))
    with pytest.raises(RuntimeError, match="needs two rounds"):
        compressor.decompress(payload, ctx)


PART_SHAPES = [torch.Size(s) for s in [(32, 16), (8, 16)] + [(48, 16), (48,), (16, 16), (16,), (16,), (64, 16)] * 3
               + [(5, 7, 3), (0,), (1, 9), (32, 16), (32,)]]  # fmt: skip
"""A small GPT's shapes (a layer's four matrices at a constant distance, three layers), a 3-D tensor,
an empty one, a matrix that would not shrink (travels whole), the head of the embedding's shape."""


def _part(shapes: list[torch.Size], start: int = 3, first: int = 0) -> Segments:
    """A part of ``shapes`` end to end from ``start`` in its buffer, keyed ``t{first}`` on."""
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(start + sum(sizes[:i]) for i in range(len(sizes)))
    return Segments(offsets, tuple(shapes), tuple(f"t{first + i}" for i in range(len(sizes))))


def _part_steps(spec: str, per_tensor: bool, steps: int = 4) -> tuple[list[torch.Tensor], Compressor]:
    """Each step's part through compress_part, the second round and decompress_part (one rank), as a
    part or by the base class's tensor by tensor; a NaN in the first tensor at the third step."""
    part = _part(PART_SHAPES)
    sizes = [math.prod(s) for s in PART_SHAPES]
    compressor = make_compressor(spec, seed=3)
    owner = Compressor if per_tensor else type(compressor)
    generator, outputs = torch.Generator().manual_seed(5), []
    for step in range(steps):
        x = torch.randn(3 + sum(sizes), generator=generator)
        if step == 2:
            x[3] = float("nan")
        states = owner.compress_part(compressor, x.clone(), part, 2.0)
        assert len(states) == (len(sizes) if per_tensor else 1)
        states = [compressor.next_round(p, c) for p, c in states]
        out = torch.zeros_like(x)
        owner.decompress_part(compressor, [p for p, _ in states], [c for _, c in states], out, part)
        outputs.append(out)
    return outputs, compressor


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "powersgd:rank=4", "powersgd:rank=2,warm_start=false"])
def test_a_part_at_once_gives_each_tensor_its_own_result_and_state(spec: str) -> None:
    """Matrices batched by shape across a part's tensors, each starting from its own key's Q: the
    outputs, every key's Q and the draws counted bitwise tensor by tensor, a NaN step keeping that
    tensor's Q as it was."""
    ours, grouped = _part_steps(spec, per_tensor=False)
    theirs, alone = _part_steps(spec, per_tensor=True)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(ours, theirs, strict=True))
    assert torch.isnan(ours[2][3 : 3 + 512]).all() and torch.isfinite(ours[2][3 + 512 :]).all()
    assert isinstance(grouped, PowerSGD) and isinstance(alone, PowerSGD)
    assert grouped.memory.keys() == alone.memory.keys()
    assert all(torch.equal(grouped.memory[k], q) and torch.isfinite(q).all() for k, q in alone.memory.items())
    counts = [sorted((e["key"], e["count"]) for e in c.counters.state_dict()["counts"]) for c in (grouped, alone)]
    assert counts[0] == counts[1] and counts[0]


@pytest.mark.parametrize("spec", ["powersgd:rank=2,ef=true", "powersgd:rank=3,ef=true,momentum=0.9,nesterov=true"])
def test_error_feedback_follows_a_part_at_once_as_tensor_by_tensor(spec: str) -> None:
    """Residuals in the part's span, settled after the second round: outputs, every key's residual,
    velocity and Q bitwise tensor by tensor over four steps (the NaN step keeps that tensor's state
    as it was), read back per key, checkpointed and resumed, taken with the tensor."""
    ours, grouped = _part_steps(spec, per_tensor=False)
    theirs, alone = _part_steps(spec, per_tensor=True)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(ours, theirs, strict=True))
    for states in ("residuals", "velocities"):
        mine, yours = getattr(grouped, states), getattr(alone, states)
        assert mine.keys() == yours.keys() and all(torch.equal(mine[k], yours[k]) for k in yours), states
    assert torch.isfinite(grouped.residuals["t0"]).all()  # type: ignore[attr-defined]
    inner = [c.inner.memory for c in (grouped, alone)]  # type: ignore[attr-defined]
    assert all(torch.equal(inner[0][k], q) for k, q in inner[1].items())
    resumed = make_compressor(spec, seed=3)
    resumed.load_state_dict(grouped.state_dict())
    assert resumed.residuals.keys() == alone.residuals.keys()  # type: ignore[attr-defined]
    taken = grouped.take_residual("t4")
    assert taken is not None and taken.shape == PART_SHAPES[4] and "t4" not in grouped.residuals  # type: ignore[attr-defined]


def test_parts_compressed_before_either_settles_keep_their_own_steps() -> None:
    """The engine compresses a bucket's next part on backward's thread while the last one's second
    round runs on the executor: each part's compensated span is its own until it settles."""
    first, second = _part(PART_SHAPES[:8]), _part(PART_SHAPES[8:], first=8)
    sizes = [sum(math.prod(s) for s in shapes) for shapes in (PART_SHAPES[:8], PART_SHAPES[8:])]
    interleaved, one_by_one = make_compressor("powersgd:rank=2,ef=true"), make_compressor("powersgd:rank=2,ef=true")
    generator = torch.Generator().manual_seed(9)
    for _ in range(3):
        xs = [torch.randn(3 + n, generator=generator) for n in sizes]
        outs = []
        for compressor, together in ((interleaved, True), (one_by_one, False)):
            results = []
            pending = [] if together else None
            for x, part in zip(xs, (first, second), strict=True):
                ((payload, ctx),) = compressor.compress_part(x.clone(), part, 2.0)
                if pending is not None:
                    pending.append((payload, ctx, part, x))
                    continue
                payload, ctx = compressor.next_round(payload, ctx)
                out = torch.zeros_like(x)
                compressor.decompress_part([payload], [ctx], out, part)
                results.append(out)
            for payload, ctx, part, x in pending or []:
                payload, ctx = compressor.next_round(payload, ctx)
                out = torch.zeros_like(x)
                compressor.decompress_part([payload], [ctx], out, part)
                results.append(out)
            outs.append(results)
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    residuals = [c.residuals for c in (interleaved, one_by_one)]  # type: ignore[attr-defined]
    assert all(torch.equal(residuals[0][k], r) for k, r in residuals[1].items())


def test_rank_one_batched_moves_a_result_by_a_few_roundings() -> None:
    """At rank 1 the factors are vector products, which BLAS computes for a batch in another order
    than for one matrix: within 16 float32 roundings of each tensor's largest value, over 4 steps."""
    ours, _ = _part_steps("powersgd:rank=1", per_tensor=False)
    theirs, _ = _part_steps("powersgd:rank=1", per_tensor=True)
    for a, b in zip(ours, theirs, strict=True):
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        assert float((a - b).abs().max()) <= 16 * torch.finfo(torch.float32).eps * float(b.abs().max())


def test_operators_per_part_grow_with_its_shapes_not_its_tensors() -> None:
    """150 GPT-shaped tensors cost what one tensor of each of their shapes costs (within 2: a batch
    of two embeddings' shape against one), a batch per shape."""
    from gradcomp.bench.launches import compare, gpt_shapes

    shapes = gpt_shapes()
    _, many = compare("powersgd:rank=4", shapes)
    _, few = compare("powersgd:rank=4", list({tuple(s): s for s in shapes}.values()))
    assert many.tensors == 150 and few.tensors == 10 and abs(many.total - few.total) <= 2, (many, few)
    assert many.total < 600  # 4,066 tensor by tensor


def test_a_checkpoint_of_generator_states_is_refused_with_the_reason() -> None:
    compressor = make_compressor("powersgd:rank=2")
    with pytest.raises(ValueError, match=r"PowerSGD's initial factors.*torch\.Generator states"):
        compressor.load_state_dict({"shared": {"seed": 0, "generators": []}, "memory": []})


def test_a_float64_default_dtype_changes_nothing() -> None:
    """epfml/powersgd's own tests set ``torch.set_default_dtype(torch.float64)``: the random starts and
    the stand-ins of keys without a Q stay float32, tensor by tensor and a part at once."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ours, _ = _part_steps("powersgd:rank=2", per_tensor=False, steps=2)
        theirs, _ = _part_steps("powersgd:rank=2", per_tensor=True, steps=2)
    finally:
        torch.set_default_dtype(previous)
    assert all(torch.equal(a, b) and a.dtype == torch.float64 for a, b in zip(ours, theirs, strict=True))
