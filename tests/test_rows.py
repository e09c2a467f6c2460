"""A part of a bucket as rows of chunks: the layout moves every element once, and the chunked
compressors that compress a part by rows send what they send tensor by tensor, in a number of
operators that does not grow with the tensors."""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp.bench.launches import compare
from gradcomp.compressors import Compressor, Meta, Segments, make_compressor
from gradcomp.compressors.bitpack import packed_size
from gradcomp.compressors.rows import ChunkRows, RowsMeta
from gradcomp.compressors.threshold import SpanMeta

SHAPES = [torch.Size(s) for s in [(40, 30), (30,), (0,), (7,), (64, 16), (1025,), (3, 1, 2)]]
CHUNK = 16


def segments(shapes: list[torch.Size], start: int = 0) -> Segments:
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(start + sum(sizes[:i]) for i in range(len(sizes)))
    return Segments(offsets, tuple(shapes), tuple(range(len(shapes))))


def bucket(numel: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) * 5).to(dtype)


def test_the_layout_holds_every_chunk_of_every_tensor_once_and_puts_it_back() -> None:
    part = segments(SHAPES, start=3)  # the part starts inside the buffer
    layout = ChunkRows.of(part, CHUNK)
    numel = sum(math.prod(s) for s in SHAPES)
    assert layout.numel == numel and layout.rows == sum(-(-math.prod(s) // CHUNK) for s in SHAPES)
    buffer = torch.arange(3 + numel, dtype=torch.float32)
    rows = layout.gather(buffer, torch.full((layout.rows, CHUNK), -1.0), "zero")
    assert sorted(layout.compact(rows).tolist()) == list(range(3, 3 + numel))  # each element once, no pad
    back = torch.zeros_like(buffer)
    layout.scatter(rows, back)
    assert torch.equal(back[3:], buffer[3:]) and back[:3].eq(0).all()
    tails = rows[layout.full_rows :]
    lengths = layout.lengths(buffer.device)[layout.full_rows :].long()
    assert all(tails[i, n:].eq(0).all() for i, n in enumerate(lengths.tolist()))  # zero pads
    first = layout.gather(buffer, torch.empty_like(rows), "first")[layout.full_rows :]
    assert all(first[i, n:].eq(first[i, 0]).all() for i, n in enumerate(lengths.tolist()))  # min and max kept


def test_compact_and_expand_are_inverse_on_the_tensors_elements() -> None:
    layout = ChunkRows.of(segments(SHAPES), CHUNK)
    rows = torch.randn(layout.rows, CHUNK)
    spread = layout.expand(layout.compact(rows), torch.zeros_like(rows))
    assert torch.equal(layout.compact(spread), layout.compact(rows))


DETERMINISTIC = ["sign", "quantize:bits=4,rounding=nearest", "quantize:bits=2,rounding=nearest,chunk=16",
                 "fp8:format=e4m3", "fp8:format=e5m2,chunk=64"]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", DETERMINISTIC)
def test_a_part_by_rows_decodes_bitwise_as_its_tensors_one_by_one(spec: str, dtype: torch.dtype) -> None:
    """Two ranks' payloads summed: the same values as tensor by tensor, in fewer bytes (the part's
    codes packed together: each tensor's own no longer rounds up to a byte). Bitwise, but for
    sign's short chunks: a tail row's mean |x| sums its zero pads too, in another order, which may
    move the scale by one rounding (full chunks are bitwise)."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    x, y = bucket(numel, 1, dtype), bucket(numel, 2, dtype)
    x[5] = float("nan")  # a non-finite value stays in its own chunk
    compressor = make_compressor(spec)
    states = [compressor.compress_part(t.clone(), part, 2.0) for t in (x, y)]
    assert len(states[0]) == 1 and isinstance(states[0][0][1], RowsMeta)  # one payload for the part
    out = torch.empty_like(x)
    compressor.decompress_sum_part([[states[0][0][0], states[1][0][0]]], [states[0][0][1]], out, part)
    reference = torch.empty_like(x)
    one = make_compressor(spec)
    for offset, shape, tensors in zip(part.offsets, part.shapes, ((x, y),) * len(SHAPES), strict=True):
        n = math.prod(shape)
        pair = [one.compress_divided(t[offset : offset + n].clone().view(shape), 2.0) for t in tensors]
        reference[offset : offset + n] = one.decompress_sum([p for p, _ in pair], pair[0][1]).view(-1)
        assert pair[0][1].numel == n
    assert torch.equal(out.isnan(), reference.isnan()) and out.isnan()[:1200].any()
    # sign's tails: each rank's scale within a rounding (its sum's order), so the sum of two within
    # two roundings of the largest scale
    rounding = 4 * torch.finfo(torch.float32).eps * float(torch.nan_to_num(reference).abs().max())
    torch.testing.assert_close(torch.nan_to_num(out), torch.nan_to_num(reference), rtol=0,
                               atol=rounding if spec == "sign" else 0.0)  # fmt: skip
    full = ChunkRows.of(part, compressor.capabilities.piece_multiple).full
    for offset, count in full:  # full chunks: bitwise for every compressor
        span = slice(offset, offset + count * compressor.capabilities.piece_multiple)
        assert torch.equal(torch.nan_to_num(out[span]), torch.nan_to_num(reference[span]))
    per_tensor = sum(one.wire_bytes(one.compress(x[o : o + math.prod(s)].view(s))[0])
                     for o, s in zip(part.offsets, part.shapes, strict=True))  # fmt: skip
    assert compressor.wire_bytes(states[0][0][0]) <= per_tensor


def test_the_part_payload_is_every_code_once_and_a_scale_per_chunk() -> None:
    compressor = make_compressor("quantize:bits=3,rounding=nearest,chunk=16")
    part = segments(SHAPES)
    ((payload, meta),) = compressor.compress_part(bucket(sum(math.prod(s) for s in SHAPES)), part, 1.0)
    packed, scales = payload
    assert packed.numel() == packed_size(meta.layout.numel, 3) and scales.shape == (2, meta.layout.rows)


@pytest.mark.parametrize("spec", ["quantize:bits=4", "quantize:bits=2,chunk=16", "terngrad", "quantize:bits=2,ef=true"])
def test_stochastic_rounding_by_rows_draws_each_tensors_noise_from_its_own_stream(spec: str) -> None:
    """Bitwise the tensors' own codes over three steps (rule "state per tensor": what a tensor
    sends does not depend on the part that holds it), in one payload for the part."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    inputs = [bucket(numel, step) for step in range(3)]
    by_rows, per_tensor = make_compressor(spec, seed=3, rank=1), make_compressor(spec, seed=3, rank=1)
    assert by_rows.capabilities.whole_part
    for ours, theirs in zip(_steps(by_rows, part, inputs, False), _steps(per_tensor, part, inputs, True), strict=True):
        assert torch.equal(ours, theirs)
    ((_, meta),) = by_rows.compress_part(inputs[0].clone(), part, 2.0)
    assert isinstance(meta, RowsMeta)


def test_qsgd_by_rows_moves_a_short_chunks_norm_by_a_rounding_at_most() -> None:
    """QSGD's norm of a short chunk sums its zero pads too, in another order: its levels may move by
    a rounding, and a value near a level's edge round the other way; full chunks are bitwise."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    x = bucket(numel, 4)
    by_rows, per_tensor = make_compressor("qsgd:bits=4,chunk=16"), make_compressor("qsgd:bits=4,chunk=16")
    ((ours,), (theirs,)) = (_steps(by_rows, part, [x], False), _steps(per_tensor, part, [x], True))
    for offset, count in ChunkRows.of(part, 16).full:
        assert torch.equal(ours[offset : offset + 16 * count], theirs[offset : offset + 16 * count])
    levels = 2 ** (4 - 1) - 1
    tails = ChunkRows.of(part, 16).tails
    norms = [float(x[o : o + n].div(2).norm()) for o, n in tails]
    for (offset, length), norm in zip(tails, norms, strict=True):  # one level of the chunk at most
        moved = float((ours[offset : offset + length] - theirs[offset : offset + length]).abs().max())
        assert moved <= norm / levels * 1.001


@pytest.mark.parametrize(
    "spec",
    ["sign", "sign:ef=true", "quantize:bits=4,rounding=nearest", "fp8:format=e4m3,ef=true", "quantize:bits=4",
     "quantize:bits=2,ef=true", "qsgd", "terngrad", "fp16:ef=true", "bf16:ef=true", "sign:ef=true,momentum=0.9",
     "threshold:tau=2.5", "threshold:tau=2.5,ef=true", "threshold:tau=2.5,ef=true,momentum=0.9,mask=true"],
)  # fmt: skip
def test_operators_per_bucket_do_not_grow_with_its_tensors(spec: str) -> None:
    """Within 5: the operators on short last chunks (gathered, padded, their pads zeroed), which a
    bucket of one matrix of whole chunks skips; none of them per tensor."""
    one, many = compare(spec)
    assert many.tensors == 150 and abs(many.total - one.total) <= 5, (one, many)


def _steps(compressor: object, part: Segments, inputs: list[torch.Tensor], per_tensor: bool) -> list[torch.Tensor]:
    """Each input through compress_part and decompress_sum_part (one rank), by rows or the
    base class's tensor by tensor."""
    from gradcomp.compressors import Compressor

    outputs = []
    for x in inputs:
        owner = Compressor if per_tensor else type(compressor)
        states = owner.compress_part(compressor, x.clone(), part, 2.0)  # type: ignore[attr-defined]
        out = torch.empty_like(x)
        gathered = [[p] for p, _ in states] if per_tensor else [[p for p, _ in states]]
        owner.decompress_sum_part(compressor, gathered, [c for _, c in states], out, part)  # type: ignore[attr-defined]
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("spec", ["quantize:bits=4,rounding=nearest,ef=true", "fp8:format=e4m3,ef=true", "sign:ef=true",
                                  "fp16:ef=true", "bf16:ef=true", "quantize:bits=2,ef=true",
                                  "threshold:tau=1.0,ef=true"])  # fmt: skip
def test_error_feedback_by_rows_keeps_each_tensors_residual_as_tensor_by_tensor(spec: str) -> None:
    """Four steps, the third with a NaN in one tensor (its residual stays, the others move on):
    outputs and residuals bitwise those of error feedback tensor by tensor (sign: within a rounding
    of its scales), the residual read back per key and resumed from a checkpoint."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    inputs = [bucket(numel, step) for step in range(4)]
    inputs[2][1240] = float("nan")  # the (64, 16) tensor at 1237
    by_rows, per_tensor = make_compressor(spec), make_compressor(spec)
    ours, theirs = _steps(by_rows, part, inputs[:3], False), _steps(per_tensor, part, inputs[:3], True)
    bound = 0.0 if not spec.startswith("sign") else 1e-5
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.nan_to_num(a), torch.nan_to_num(b), rtol=0, atol=bound)
    assert not torch.isfinite(ours[2][1237:2261]).all() and torch.isfinite(ours[2][:1237]).all()
    saved = by_rows.state_dict()  # every key's residual, out of the rows
    assert sorted(k for k in saved_keys(saved)) == sorted(per_tensor.residuals)
    for key, residual in per_tensor.residuals.items():
        torch.testing.assert_close(by_rows.residuals[key], residual, rtol=0, atol=bound)
    resumed = make_compressor(spec)
    resumed.load_state_dict(saved)
    again, straight = _steps(resumed, part, inputs[3:], False), _steps(by_rows, part, inputs[3:], False)
    assert torch.equal(again[0], straight[0])
    taken = by_rows.take_residual(4)  # held by the rows: brought out, and forgotten there
    assert taken is not None and taken.shape == SHAPES[4] and 4 not in by_rows.residuals


@pytest.mark.parametrize("spec", ["fp8:format=e4m3,ef=true", "fp16:ef=true", "quantize:bits=4,ef=true"])
def test_a_pads_stale_bytes_never_decide_a_tensors_step(spec: str) -> None:
    """A pad's code never travels, so it decodes from whatever the scratch held: here NaN (fp8's
    code 0xFF) everywhere. Every tensor's step is still finite and its residual moves on, bitwise
    as tensor by tensor."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    inputs = [bucket(numel, step) for step in range(2)]
    by_rows, per_tensor = make_compressor(spec), make_compressor(spec)
    _steps(by_rows, part, inputs[:1], False)
    scratch = [*by_rows.workspace._buffers.values(), *by_rows.inner.workspace._buffers.values()]  # type: ignore[attr-defined]
    for buffer in scratch:
        buffer.fill_(float("nan") if buffer.is_floating_point() else -1)
    _steps(by_rows, part, inputs[1:], False)
    _steps(per_tensor, part, inputs, True)
    for key, residual in per_tensor.residuals.items():
        assert torch.isfinite(by_rows.residuals[key]).all() and torch.equal(by_rows.residuals[key], residual), key


def saved_keys(state: dict[str, object]) -> list[object]:
    return [entry["key"] for entry in state["residuals"]]  # type: ignore[attr-defined]


def test_a_regrouped_bucket_takes_its_tensors_residuals_along() -> None:
    """DDP regroups its buckets after its first step: the residuals move from one part's rows to
    another's, as they move between buckets tensor by tensor."""
    spec = "quantize:bits=4,rounding=nearest,ef=true"
    whole, first, second = segments(SHAPES), segments(SHAPES[:4]), segments(SHAPES[4:])
    numel = sum(math.prod(s) for s in SHAPES)
    split = sum(math.prod(s) for s in SHAPES[:4])
    regrouped = Segments(second.offsets, second.shapes, tuple(range(4, len(SHAPES))))
    by_rows, per_tensor = make_compressor(spec), make_compressor(spec)
    x, y = bucket(numel, 1), bucket(numel, 2)
    for compressor, flag in ((by_rows, False), (per_tensor, True)):
        _steps(compressor, whole, [x], flag)
        _steps(compressor, first, [y[:split]], flag)
        _steps(compressor, regrouped, [y[split:].clone()], flag)
    for key, residual in per_tensor.residuals.items():
        assert torch.equal(by_rows.residuals[key], residual), key


MOMENTUM_SPECS = ["quantize:bits=4,rounding=nearest,ef=true,momentum=0.9", "fp16:ef=true,momentum=0.9,nesterov=true",
                  "quantize:bits=2,ef=true,momentum=0.5",
                  "threshold:tau=1.0,ef=true,momentum=0.9,mask=true"]  # fmt: skip


@pytest.mark.parametrize("spec", MOMENTUM_SPECS)
def test_momentum_correction_by_rows_keeps_each_tensors_velocity_as_tensor_by_tensor(spec: str) -> None:
    """DGC's momentum correction follows the rows: outputs, residuals and velocities bitwise those
    tensor by tensor over four steps, the third with a NaN in one tensor (its residual and velocity
    stay), the velocities read back per key, checkpointed and resumed, taken with the tensor."""
    part = segments(SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    inputs = [bucket(numel, step) for step in range(4)]
    inputs[2][1240] = float("nan")  # the (64, 16) tensor at 1237
    by_rows, per_tensor = make_compressor(spec), make_compressor(spec)
    assert by_rows.capabilities.whole_part
    ours, theirs = _steps(by_rows, part, inputs[:3], False), _steps(per_tensor, part, inputs[:3], True)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    for states in ("residuals", "velocities"):
        mine, yours = getattr(by_rows, states), getattr(per_tensor, states)
        assert mine.keys() == yours.keys() and all(torch.equal(mine[k], yours[k]) for k in yours), states
    assert torch.isfinite(by_rows.velocities[4]).all()  # the NaN step kept the velocity as it was
    resumed = make_compressor(spec)
    resumed.load_state_dict(by_rows.state_dict())
    again, straight = _steps(resumed, part, inputs[3:], False), _steps(by_rows, part, inputs[3:], False)
    assert torch.equal(again[0], straight[0])
    by_rows.take_residual(4)
    assert 4 not in by_rows.velocities and 4 not in by_rows.residuals


def gapped(shapes: list[torch.Size]) -> Segments:
    """A part whose tensors do not lie end to end (a per-tensor policy's): 3 elements between each."""
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(sum(sizes[:i]) + 3 * i for i in range(len(sizes)))
    return Segments(offsets, tuple(shapes), tuple(range(len(shapes))))


@pytest.mark.parametrize("layout", ["span", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tau", [0.0, 1.0, 50.0])
def test_threshold_selects_a_part_at_once_as_each_tensor_alone(tau: float, dtype: torch.dtype, layout: str) -> None:
    """One selection for the part, where it lies (tensors end to end) or by rows: the elements each
    tensor alone sends (NaN included, a pad never, even at tau = 0, where everything else travels),
    two ranks' values summed bitwise as tensor by tensor; the indices run over the part."""
    part = segments(SHAPES) if layout == "span" else gapped(SHAPES)
    numel = part.offsets[-1] + math.prod(SHAPES[-1])
    x, y = bucket(numel, 1, dtype), bucket(numel, 2, dtype)
    x[5] = float("nan")
    compressor, one = make_compressor(f"threshold:tau={tau}"), make_compressor(f"threshold:tau={tau}")
    states = [compressor.compress_part(t.clone(), part, 2.0) for t in (x, y)]
    ((payload, meta),) = states[0]
    assert isinstance(meta, SpanMeta if layout == "span" else RowsMeta)
    assert payload[1].dtype == torch.int16  # 3,292 elements, or 17 rows of 256
    alone = [one.compress_divided(x[o : o + math.prod(s)].clone().view(s), 2.0)[0]
             for o, s in zip(part.offsets, part.shapes, strict=True)]  # fmt: skip
    assert payload[0].numel() == sum(p[0].numel() for p in alone) == (3292 if tau == 0 else payload[0].numel())
    out, reference = torch.zeros_like(x), torch.zeros_like(x)
    compressor.decompress_sum_part([[states[0][0][0], states[1][0][0]]], [meta], out, part)
    Compressor.decompress_sum_part(one, [[one.compress_divided(t[o : o + math.prod(s)].clone().view(s), 2.0)[0]
                                          for t in (x, y)] for o, s in zip(part.offsets, part.shapes, strict=True)],
                                   [Meta.of(v) for v in part.views(x)], reference, part)  # fmt: skip
    assert torch.equal(out.isnan(), reference.isnan()) and bool(out[5].isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(reference))


@pytest.mark.parametrize("spec", ["threshold:tau=1.0", "threshold:tau=1.0,ef=true",
                                  "threshold:tau=0.5,ef=true,momentum=0.9,mask=true"])  # fmt: skip
def test_a_measured_part_compresses_on_another_thread_as_the_part_at_once(spec: str) -> None:
    """The accelerator's path: a part measured on one thread (backward's) and compressed at its count
    on another (the executor's) sends and keeps what compressing it at once does, over four steps,
    the third with a NaN in one tensor; one record for the whole part."""
    import concurrent.futures

    part = segments(SHAPES) if "ef=true" in spec else gapped(SHAPES)  # the span or the rows
    numel = part.offsets[-1] + math.prod(SHAPES[-1])
    inputs = [bucket(numel, step) for step in range(4)]
    inputs[2][1240] = float("nan")
    at_once, measured = make_compressor(spec), make_compressor(spec)
    executor = concurrent.futures.ThreadPoolExecutor(1)
    for x in inputs:
        ((expected, _),) = at_once.compress_part(x.clone(), part, 2.0)
        records = measured.measure_part(x.clone(), part, 2.0)
        assert len(records) == 1
        counts = [int(record.count) for record in records]
        ((payload, meta),) = executor.submit(measured.compress_measured_part, records, counts, part).result()
        assert isinstance(meta, RowsMeta) and payload[0].numel() == counts[0]  # by rows: EF's, or a gapped part's
        pairs = zip(payload, expected, strict=True)
        assert all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) for a, b in pairs)
    executor.shutdown()
    if hasattr(at_once, "residuals"):
        assert all(torch.equal(measured.residuals[k], r) for k, r in at_once.residuals.items())
        assert all(torch.equal(measured.velocities[k], v) for k, v in at_once.velocities.items())
