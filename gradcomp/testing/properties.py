"""The compressor contract (``gradcomp/compressors/base.py``), one function per property, on one
process: each raises ``AssertionError`` saying what broke, or :class:`Skip` where it does not apply.

Inputs come from fixed seeds, so a check gives the same verdict on every run; the statistical one
(unbiasedness) has a margin of several standard deviations over what unbiased compressors give.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradcomp.compressors.base import Aggregation, Capabilities, Compressor, CompressorConfig, Payload
from gradcomp.compressors.finite import payload_finite
from gradcomp.compressors.registry import REGISTRY, parse_spec
from gradcomp.compressors.simulate import aggregate, compress_all, roundtrip
from gradcomp.testing.subject import Subject, gaussian, rounds

RANKS = 3
"""Simulated ranks for the properties between ranks (one process, payloads summed or gathered)."""
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SHAPES = ((1,), (4097,), (64, 50), (3, 5, 7))


def _copy(payload: Payload) -> Payload:
    return tuple(t.clone() for t in payload)


def _differs(a: Tensor, b: Tensor) -> str:
    """How two tensors that should be equal differ, in a few words."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    where = (a != b) & ~(a.isnan() & b.isnan())
    gaps = (a - b)[where].abs()
    gaps = gaps[~gaps.isnan()]
    by = f"by up to {float(gaps.max()):.3g}" if gaps.numel() else "NaN against numbers"
    return f"{int(where.sum())} of {a.numel()} elements, {by}"


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def declarations(subject: Subject) -> None:
    """The class declares what the engine reads: a name, a frozen config dataclass with defaults,
    its :class:`Capabilities` for that config (``declare``: an aggregation, its rounds, and
    ``next_round`` if more than one), and a spec that rebuilds it."""
    cls = subject.cls
    assert isinstance(cls.name, str) and cls.name, f"name must be a non-empty string, got {cls.name!r}"
    assert isinstance(subject.config, CompressorConfig), f"Config must subclass CompressorConfig, got {cls.Config}"
    try:
        declared = subject.declared
    except Exception as error:
        raise AssertionError(f"declare(config) raised {type(error).__name__}: {error}") from None
    assert isinstance(declared, Capabilities), f"declare(config) must return Capabilities, got {declared!r}"
    rounds = declared.rounds
    if rounds > 1:
        assert cls.next_round is not Compressor.next_round, f"{rounds} rounds declared, next_round not defined"
    if REGISTRY.get(cls.name) is cls:
        rebuilt = parse_spec(subject.spec_text).config
        assert rebuilt == subject.config, f"its spec {subject.spec_text!r} rebuilds another config: {rebuilt}"


def input_types(subject: Subject) -> None:
    """Integer and boolean tensors, and anything that is not a tensor, raise ``TypeError``."""
    for bad in (torch.ones(10, dtype=torch.int64), torch.ones(10, dtype=torch.bool), [1.0, 2.0]):
        try:
            subject.make().compress(bad)  # type: ignore[arg-type]
        except TypeError:
            continue
        except Exception as error:
            raise AssertionError(f"{_kind(bad)} raised {type(error).__name__} ({error}), not TypeError") from None
        raise AssertionError(f"{_kind(bad)} was compressed; it must raise TypeError")


def _kind(value: object) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}"


def shape_and_dtype(subject: Subject) -> None:
    """Every floating dtype and shape decompresses to a finite, contiguous tensor of the input's
    shape and dtype."""
    for dtype in DTYPES:
        compressor = subject.make()
        for shape in SHAPES:
            y = roundtrip(compressor, gaussian(*shape, dtype=dtype), key=(shape, str(dtype)))
            where = f"{dtype} {shape}"
            assert y.shape == shape and y.dtype == dtype, f"{where} came back {y.dtype} {tuple(y.shape)}"
            assert y.is_contiguous(), f"{where} came back non-contiguous"
            assert bool(torch.isfinite(y).all()), f"{where}: finite input came back with non-finite values"


def wire_bytes(subject: Subject) -> None:
    """Payloads are tuples of contiguous tensors on the input's device, and ``wire_bytes`` is
    exactly their storage (the engine's statistics, the cost model and the report count it)."""
    compressor = subject.make()
    for shape in ((1,), (4097,), (64, 50)):
        payloads, _ = rounds(compressor, gaussian(*shape), key=shape)
        for number, payload in enumerate(payloads, 1):
            where = f"round {number}'s payload of a {shape} tensor"
            assert isinstance(payload, tuple) and all(isinstance(t, Tensor) for t in payload), (
                f"{where} is {type(payload).__name__}, not a tuple of tensors"
            )
            assert all(t.is_contiguous() and t.device.type == "cpu" for t in payload), (
                f"{where} holds a non-contiguous tensor or one on another device"
            )
            storage = sum(t.numel() * t.element_size() for t in payload)
            said = compressor.wire_bytes(payload)
            assert said == storage, f"wire_bytes says {said} bytes for {where}, which holds {storage}"


def payload_only(subject: Subject) -> None:
    """Only the payload travels: a rank's payload decompresses to the same tensor with any rank's
    context, so nothing a rank keeps in its context is needed elsewhere."""
    compressors = [subject.make(rank=r) for r in range(RANKS)]
    contexts, finals = compress_all(compressors, [gaussian(64, 50, seed=r) for r in range(RANKS)], key="w")
    for q in range(RANKS):
        own = compressors[q].decompress(_copy(finals[q]), contexts[q])
        for r in range(RANKS):
            there = compressors[r].decompress(_copy(finals[q]), contexts[r])
            assert _equal(own, there), (
                f"rank {q}'s payload decompressed with rank {r}'s context differs from its own "
                f"({_differs(own, there)}): the context carries what only the sender has"
            )


def aggregation(subject: Subject) -> None:
    """Every rank's aggregate is bitwise the same (payloads combined in rank order), and it is the
    sum of what each payload decompresses to."""
    compressors = [subject.make(rank=r) for r in range(RANKS)]
    contexts, finals = compress_all(compressors, [gaussian(64, 50, seed=r) for r in range(RANKS)], key="w")
    parts = [compressors[q].decompress(_copy(finals[q]), contexts[q]).clone() for q in range(RANKS)]
    results = aggregate(compressors, contexts, finals)
    for r, result in enumerate(results[1:], 1):
        assert _equal(result, results[0]), f"rank {r}'s aggregate differs from rank 0's: {_differs(result, results[0])}"
    expected = torch.stack(parts).sum(0)
    error = float((results[0] - expected).norm())
    # sum payloads add in their own dtype (as an all-reduce does): a half-precision one rounds there
    floats = [torch.finfo(t.dtype).eps for t in finals[0] if t.is_floating_point()]
    summed = subject.declared.aggregation is Aggregation.SUM
    precision = max([1e-5] + [RANKS * eps for eps in floats]) if summed else 1e-5
    total = float(expected.norm())
    assert error <= precision * total + 1e-6, (
        f"the aggregate is not the sum of the decompressed payloads (off by {error:.3g} of {total:.3g})"
    )


def determinism(subject: Subject) -> None:
    """Two compressors built with the same seed and rank make bitwise the same payloads, step after
    step: runs repeat, resumes continue, and ranks agree on what they share (seeded generators, not
    the global one)."""
    for rank in (0, 1):
        a, b = subject.make(seed=5, rank=rank), subject.make(seed=5, rank=rank)
        for step in range(3):
            x = gaussian(64, 50, seed=step)
            payloads_a, _ = rounds(a, x.clone(), key="w")
            payloads_b, _ = rounds(b, x.clone(), key="w")
            for number, (pa, pb) in enumerate(zip(payloads_a, payloads_b, strict=True), 1):
                assert len(pa) == len(pb) and all(_equal(ta, tb) for ta, tb in zip(pa, pb, strict=False)), (
                    f"two builds with seed 5, rank {rank} made different payloads (step {step + 1}, round {number})"
                )


def decompression(subject: Subject) -> None:
    """Zeros come back zeros; ``out=`` is written and returned; the result approximates the input:
    unbiased where the compressor says so (the mean of many compressions, measured), else a
    contraction, ``|C(x) - x| < |x|`` (what error feedback needs)."""
    compressor = subject.make()
    zeros = torch.zeros(50, 40)
    assert torch.equal(roundtrip(compressor, zeros, key="zeros"), zeros), "zeros did not come back zeros"
    x = gaussian(64, 50)
    contexts, finals = compress_all([compressor], [x], key="out")
    expected = compressor.decompress(_copy(finals[0]), contexts[0]).clone()
    out = torch.full_like(x, float("nan"))
    result = compressor.decompress(_copy(finals[0]), contexts[0], out=out)
    assert result.data_ptr() == out.data_ptr(), "decompress(..., out=out) did not return out"
    assert _equal(out, expected), f"decompress into out differs from decompress: {_differs(out, expected)}"
    if subject.declared.unbiased:  # error feedback's wrapper is biased by design: its codec decides
        _unbiased(subject)
    else:  # through decompress (error feedback's contribution) and decompress_sum (the aggregate)
        plain = subject.plain()
        contexts, finals = compress_all([plain], [x], key="x")
        alone = plain.decompress(_copy(finals[0]), contexts[0])
        for name, y in (("decompress", alone), ("decompress_sum", plain.decompress_sum([finals[0]], contexts[0]))):
            ratio = float((y - x).norm() / x.norm())
            assert ratio < 1.0, (
                f"{name}: |C(x) - x| = {ratio:.3f} |x|, no closer to x than zeros are (a biased compressor "
                "must be a contraction)"
            )


def _unbiased(subject: Subject, trials: int = 400) -> None:
    """E[C(x)] = x, measured: ``T = |mean - x|^2`` for the mean of ``trials`` compressions of one
    tensor, against what unbiased compressions give it, ``V`` = their variance / ``trials`` (estimated
    from them). Unbiased, T / V is about 1 (over 1024 elements within ~0.1, even for a random-k
    keeping 1% of them, whose elements each travel ~4 times); a bias ``b`` adds ``|b|^2`` to T, which
    more trials do not shrink, and V does not see."""
    x = gaussian(1024, seed=3).double()
    compressor = subject.plain(seed=11)
    samples = torch.stack([roundtrip(compressor, x.float(), key="unbiased").double() for _ in range(trials)])
    mean = samples.mean(0)
    error = float(((mean - x) ** 2).sum())
    variance = float(((samples - mean) ** 2).sum()) / (trials - 1) / trials
    if variance == 0.0:  # every compression alike: unbiased only if exact (to float32's rounding)
        assert error <= (1e-6 * float(x.norm())) ** 2, f"deterministic and off the input by {error**0.5:.3g}: biased"
        return
    ratio = error / variance
    assert ratio < 1.5, (
        f"the mean of {trials} compressions is {ratio:.1f} times further from the input than unbiased "
        "compressions put it: biased"
    )


def empty_input(subject: Subject) -> None:
    """Empty tensors compress and decompress to empty tensors of the same shape and dtype."""
    for shape in ((0,), (3, 0), (0, 5, 2)):
        y = roundtrip(subject.make(), torch.empty(shape))
        assert y.shape == shape and y.dtype == torch.float32, f"an empty {shape} tensor came back {tuple(y.shape)}"


def non_contiguous_input(subject: Subject) -> None:
    """A non-contiguous tensor compresses as its contiguous copy does."""
    x = gaussian(30, 40).t()
    y = roundtrip(subject.make(seed=1), x)
    expected = roundtrip(subject.make(seed=1), x.contiguous())
    assert y.shape == x.shape, f"a transposed {tuple(x.shape)} tensor came back {tuple(y.shape)}"
    assert _equal(y, expected), f"a transposed tensor differs from its contiguous copy: {_differs(y, expected)}"


def non_finite_input(subject: Subject) -> None:
    """A NaN or Inf in the gradient gives a non-finite result (so ``GradScaler`` skips the step)."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 777, 1999):
            x = gaussian(2000)
            x[where] = bad
            y = roundtrip(subject.make(), x.view(40, 50))
            assert not bool(torch.isfinite(y).all()), f"{bad} at element {where} was dropped: the result is finite"


def numerical_range(subject: Subject) -> None:
    """Huge and tiny finite gradients stay finite (unless the payload's format cannot hold them, as
    a cast to fp16 cannot), and fp16 gradients near fp16's limit do too."""
    for dtype, scale in ((torch.float32, 1e30), (torch.float32, 1e-30), (torch.bfloat16, 1e30), (torch.float16, 2e4)):
        x = (gaussian(2000, dtype=torch.float64) / 3 * scale).to(dtype)
        compressor = subject.make()
        payloads, _ = rounds(compressor, x.clone(), key="range")
        y = roundtrip(subject.make(), x, key="range")
        narrow = any(t.is_floating_point() and torch.finfo(t.dtype).max < float(x.abs().max()) for t in payloads[0])
        if not narrow:
            assert bool(torch.isfinite(y).all()), f"{dtype} values of magnitude {scale:g} came back non-finite"


def error_feedback(subject: Subject) -> None:
    """Inside error feedback nothing is lost: ``g + e_old == contribution + e_new`` at every step,
    what was sent plus the residual is the sum of the gradients, and the residual stays bounded."""
    ef = subject.with_feedback()
    grads = [gaussian(40, 30, seed=s) for s in range(12)]
    sent = torch.zeros_like(grads[0])
    for step, g in enumerate(grads, 1):
        e_old = ef.residuals.get("w", torch.zeros_like(g)).clone()
        contexts, finals = compress_all([ef], [g.clone()], key="w")
        contribution = ef.contribution(_copy(finals[0]), contexts[0])
        sent += contribution
        e_new = ef.residuals["w"]
        error = float((g + e_old - contribution - e_new).abs().max())
        assert error <= 1e-6 * float((g + e_old).abs().max()), (
            f"step {step}: g + e_old differs from contribution + e_new by {error:.3g}"
        )
    total, residual = torch.stack(grads).sum(0), ef.residuals["w"]
    lost = float((sent + residual - total).abs().max())
    # float32 rounding of each step's adds, at the largest magnitude the sums reach
    scale = max(float(t.abs().max()) for t in (sent, residual, total))
    assert lost <= 4 * len(grads) * torch.finfo(torch.float32).eps * scale, (
        f"over {len(grads)} steps {lost:.3g} was lost"
    )
    mean_norm = float(torch.stack([g.norm() for g in grads]).mean())
    assert float(ef.residuals["w"].norm()) < 5 * mean_norm, "the residual grows: the compressor is no contraction"


def checkpoints(subject: Subject) -> None:
    """``state_dict`` loads with ``torch.load(weights_only=True)``, and a compressor restored from it
    continues bitwise as the one that never stopped (alone and inside error feedback)."""
    builds: list[tuple[str, Callable[[], Compressor]]] = [("", lambda: subject.make(seed=4))]
    if not subject.feedback_problem:
        builds.append((" inside error feedback", lambda: subject.with_feedback(seed=4)))
    grads = [gaussian(40, 30, seed=s) for s in range(6)]
    for inside, build in builds:
        reference, first = build(), build()
        for g in grads[:3]:
            compress_all([reference], [g.clone()], key=("layer", 0))
            compress_all([first], [g.clone()], key=("layer", 0))
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        try:
            state = torch.load(buffer, weights_only=True)
        except Exception as error:
            raise AssertionError(f"state_dict{inside} does not load with weights_only=True: {error}") from None
        resumed = build()
        resumed.load_state_dict(state)
        for step, g in enumerate(grads[3:], 4):
            final_a = compress_all([reference], [g.clone()], key=("layer", 0))[1]
            final_b = compress_all([resumed], [g.clone()], key=("layer", 0))[1]
            same = len(final_a[0]) == len(final_b[0]) and all(
                _equal(a, b) for a, b in zip(final_a[0], final_b[0], strict=False)
            )
            assert same, f"resumed{inside}, step {step}'s payload differs from the uninterrupted run's"


def declared_capabilities(subject: Subject) -> None:
    """What the compressor declares (its :class:`Capabilities`), the engine relies on:
    ``elementwise`` (a concatenation compresses as the concatenation), ``local`` (pieces cut at
    ``piece_multiple`` compress as the whole),
    ``same_shapes`` (payload shapes do not depend on values), ``measures`` (``compress_measured``
    is ``compress``), ``payload_shows_non_finite``, ``compress_divided`` (bitwise ``compress`` of the
    quotient), ``subtract_contribution`` and ``sent_indices``."""
    c = subject.make()
    declared = c.capabilities
    x = gaussian(999)
    deterministic = _equal(roundtrip(subject.make(seed=1), x), roundtrip(subject.make(seed=2), x))
    if declared.elementwise:
        a, b = gaussian(300, seed=1), gaussian(200, seed=2)
        whole = roundtrip(subject.make(), torch.cat([a, b]))
        parts = torch.cat([roundtrip(subject.make(), a), roundtrip(subject.make(), b)])
        assert _equal(whole, parts), f"elementwise, yet a concatenation compresses otherwise: {_differs(whole, parts)}"
    if declared.local and deterministic:
        m = declared.piece_multiple
        x = gaussian(5 * m + 3)
        whole = roundtrip(subject.make(), x)
        parts = torch.cat([roundtrip(subject.make(), x[: 2 * m]), roundtrip(subject.make(), x[2 * m :])])
        assert _equal(whole, parts), f"local, yet pieces cut at {m} compress otherwise: {_differs(whole, parts)}"
    if declared.same_shapes:
        shapes = {tuple(tuple(t.shape) for t in rounds(subject.make(rank=r), gaussian(64, 50, seed=r))[0][0])
                  for r in range(RANKS)}  # fmt: skip
        assert len(shapes) == 1, f"same_shapes, yet payloads of different values have shapes {sorted(shapes)}"
    if declared.measures:  # as the engine calls them: measured (divided), read, compressed to that size
        x, measuring = gaussian(64, 50), subject.make()
        measured = measuring.measure_divided(x.clone(), 2.0, "w")
        count = int(measured.count)
        payload, _ = measuring.compress_measured(measured, count, "w")
        expected, _ = subject.make().compress_divided(x.clone(), 2.0, "w")
        length = measuring.payload_length(count, measured)
        assert all(t.dim() == 1 and t.numel() == length for t in payload), "a measured payload is not of payload_length"
        assert len(payload) == len(expected) and all(_equal(a, b) for a, b in zip(payload, expected, strict=False)), (
            "compress_measured is not compress"
        )
    if declared.payload_shows_non_finite:
        x = gaussian(64, 50)
        x[7, 7] = float("nan")
        payload, _ = subject.make().compress(x)
        assert not bool(payload_finite(payload)), "payload_shows_non_finite, yet a NaN input left the payload finite"
    _divided(subject)
    x = gaussian(64, 50)
    payloads, ctx = rounds(c, x.clone(), "s")
    payload = payloads[-1]
    indices = c.sent_indices(payload, ctx)
    if indices is not None:
        assert indices.dtype == torch.int64 and indices.dim() == 1, "sent_indices must be a 1-D int64 tensor"
        assert bool(((indices >= 0) & (indices < x.numel())).all()), "sent_indices holds indices out of the tensor"
    target = x.clone().view(-1)
    if c.subtract_contribution(payload, ctx, target):
        difference = x.view(-1) - c.contribution(payload, ctx).view(-1)
        assert torch.allclose(target, difference, rtol=0, atol=1e-6 * float(x.abs().max())), (
            "subtract_contribution is not tensor - contribution"
        )


def _divided(subject: Subject) -> None:
    x = gaussian(64, 50)
    divided, _ = subject.make(seed=3).compress_divided(x.clone(), 3.0, "w")
    plain, _ = subject.make(seed=3).compress(x / 3.0, "w")
    assert len(divided) == len(plain) and all(_equal(a, b) for a, b in zip(divided, plain, strict=False)), (
        "compress_divided(x, 3) is not compress(x / 3), bitwise"
    )


Property = Callable[[Subject], None]
PROPERTIES: Sequence[tuple[str, Property]] = (
    ("declarations", declarations),
    ("input types", input_types),
    ("shape and dtype", shape_and_dtype),
    ("wire bytes", wire_bytes),
    ("payload only", payload_only),
    ("aggregation", aggregation),
    ("determinism", determinism),
    ("decompression", decompression),
    ("empty input", empty_input),
    ("non-contiguous input", non_contiguous_input),
    ("non-finite input", non_finite_input),
    ("numerical range", numerical_range),
    ("error feedback", error_feedback),
    ("checkpoints", checkpoints),
    ("declared capabilities", declared_capabilities),
)
"""Every property checked on one process, by name, in order."""
