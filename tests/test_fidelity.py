"""What training with compression needs besides error feedback: DGC's momentum correction, factor
masking and local clipping, EF21, and their state, against hand-computed references.

The engine's warm-up (uncompressed steps, the sparsifiers' ratio schedule) is tested on real gloo
ranks in ``tests/test_fidelity_engine.py``.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from gradcomp import make_compressor, parse_spec
from gradcomp.compressors.feedback import ErrorFeedback, Feedback
from gradcomp.compressors.simulate import aggregate, compress_all, sum_payloads
from gradcomp.engine.spec import HookSpec, warmup_ratio

RANKS = 3


def gradients(step: int, n: int = 200, ranks: int = RANKS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=generator) for _ in range(ranks)]


def averaged(compressors: list, grads: list[torch.Tensor], key: str = "w") -> torch.Tensor:
    """Every rank's share g / p compressed (compress_divided, as the engine does), aggregated."""
    states = [c.compress_divided(g.clone(), len(grads), key) for c, g in zip(compressors, grads, strict=True)]
    contexts, finals = [ctx for _, ctx in states], [p for p, _ in states]
    results = aggregate(compressors, contexts, finals)
    assert all(torch.equal(r, results[0]) for r in results)
    return results[0]


# -- specs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("topk:ratio=0.1,ef=true,momentum=0.9", "topk:ratio=0.1,method=exact,tolerance=0.2,ef=true,momentum=0.9"),
        ("sign:ef=ef21", "sign:chunk=1024,ef=ef21"),
        ("sign:ef=ef21,clip=2", "sign:chunk=1024,ef=ef21,clip=2.0"),
        (
            "topk:ef=true,mask=true,momentum=0.5,nesterov=true",
            "topk:ratio=0.01,method=exact,tolerance=0.2,ef=true,momentum=0.5,nesterov=true,mask=true",
        ),
    ],
)
def test_feedback_options_have_a_canonical_text(text: str, canonical: str) -> None:
    assert str(parse_spec(text)) == canonical
    assert str(parse_spec(canonical)) == canonical
    assert str(HookSpec.parse(canonical + ",seed=5")) == canonical + ",seed=5"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("topk:momentum=0.9", "needs ef=true"),
        ("topk:ef=ef21,momentum=0.9", "needs ef=true"),
        ("topk:ef=true,momentum=1.0", r"momentum must be in \[0, 1\)"),
        ("topk:ef=true,nesterov=true", "nesterov needs momentum"),
        ("topk:ef=true,mask=true", "mask applies to the momentum correction"),
        ("topk:clip=1", "clip bounds what error feedback accumulates"),
        ("topk:ef=true,clip=-1", "clip must be a finite number >= 0"),
        ("topk:ef=yes-please", "true, false or ef21"),
        ("randomk:ef=ef21", "no contraction"),
        ("topk:ef=ef21,warmup=3", "no warmup"),
        ("quantize:ef=ef21,aggregation=two_phase", "use gather"),
        ("topk:warmup=-1", "warmup must be an integer >= 0"),
    ],
)
def test_bad_feedback_options_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HookSpec.parse(text)


# -- momentum correction ------------------------------------------------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_without_dropping_is_momentum_sgd(nesterov: bool) -> None:
    """Nothing dropped (ratio 1) and no masking: the average of every rank's corrected velocity is
    torch's SGD momentum buffer of the averaged gradient (nesterov: g + m buf)."""
    m = 0.9
    spec = f"topk:ratio=1,ef=true,momentum={m},mask=false" + (",nesterov=true" if nesterov else "")
    compressors = [make_compressor(spec, rank=r) for r in range(RANKS)]
    buffer = torch.zeros(200, dtype=torch.float64)
    for step in range(6):
        grads = gradients(step)
        mean = torch.stack(grads).double().mean(0)
        buffer = m * buffer + mean
        expected = mean + m * buffer if nesterov else buffer
        torch.testing.assert_close(averaged(compressors, grads).double(), expected, rtol=1e-5, atol=1e-6)


def test_momentum_factor_masking_clears_exactly_the_sent_coordinates() -> None:
    compressor = make_compressor("topk:ratio=0.1,ef=true,momentum=0.9,mask=true")
    assert isinstance(compressor, ErrorFeedback)
    velocity = torch.zeros(200)
    residual = torch.zeros(200)
    for step in range(4):
        g = gradients(step, ranks=1)[0]
        payload, _ = compressor.compress_divided(g.clone(), 1, "w")
        sent = payload[1].long()
        velocity = torch.add(g, velocity, alpha=0.9)  # u = m u + g, as the compressor computes it
        compensated = velocity + residual
        residual = compensated.clone()
        residual[sent] = 0
        velocity[sent] = 0
        assert torch.equal(compressor.velocities["w"], velocity)
        assert torch.equal(compressor.residuals["w"], residual)
        assert torch.equal(payload[0], compensated[sent])


def test_a_non_finite_step_leaves_the_velocity_as_it_was() -> None:
    compressor = make_compressor("topk:ratio=0.1,ef=true,momentum=0.9")
    assert isinstance(compressor, ErrorFeedback)
    compressor.compress(torch.randn(100), "w")
    before = compressor.velocities["w"].clone(), compressor.residuals["w"].clone()
    bad = torch.randn(100)
    bad[7] = math.nan
    compressor.compress(bad, "w")
    assert torch.equal(compressor.velocities["w"], before[0]) and torch.equal(compressor.residuals["w"], before[1])


def test_a_dense_share_is_the_momentum_corrected_share_and_keeps_state_on_a_bad_step() -> None:
    """A warm-up step's share: u = m u + g / p, sent whole (the residual then is zero); a NaN share
    travels as it is and leaves the velocity as it was."""
    compressor = make_compressor("topk:ratio=0.1,ef=true,momentum=0.5")
    assert isinstance(compressor, ErrorFeedback)
    g = torch.randn(50)
    share = g.clone()
    compressor.dense_share(share, 2, "w")
    torch.testing.assert_close(share, g / 2)
    share = g.clone()
    compressor.dense_share(share, 2, "w")
    torch.testing.assert_close(share, g / 2 + 0.5 * (g / 2))
    assert torch.equal(compressor.velocities["w"], share) and not compressor.residuals["w"].any()
    before = compressor.velocities["w"].clone()
    bad = g.clone()
    bad[3] = math.nan
    compressor.dense_share(bad, 2, "w")
    assert bad.isnan().any() and torch.equal(compressor.velocities["w"], before)


# -- local clipping -----------------------------------------------------------------------------


def test_local_clipping_bounds_each_share_by_the_scaled_threshold() -> None:
    """With nothing dropped, the average is the sum of the shares g / p, each clipped to the norm
    clip / sqrt(p)."""
    clip = 1.0
    compressors = [make_compressor(f"topk:ratio=1,ef=true,clip={clip}", rank=r) for r in range(RANKS)]
    grads = [g * 10 for g in gradients(0)]  # norms ~ 140: every share is clipped
    grads[0] = grads[0] * 1e-3  # but not this one (norm ~ 0.05 < 1 / sqrt(3))
    limit = clip / math.sqrt(RANKS)
    shares = [g / RANKS for g in grads]
    expected = sum(s * min(1.0, limit / float(s.norm())) for s in shares)
    torch.testing.assert_close(averaged(compressors, grads), expected, rtol=1e-5, atol=1e-7)


# -- EF21 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["quantize:bits=2,chunk=50,ef=ef21", "topk:ratio=0.05,ef=ef21", "powersgd:rank=1,ef=ef21"]
)
def test_ef21_global_estimate_is_the_sum_of_the_local_ones(spec: str) -> None:
    """EF21's invariant: every rank hands on the same G, and G = sum of the ranks' estimates h
    (each moved by exactly what its payload carried)."""
    compressors = [make_compressor(spec, rank=r) for r in range(RANKS)]
    shapes = [torch.Size([10, 20])]
    for step in range(5):
        grads = gradients(step)
        states = [c.compress_divided(g.clone(), RANKS, "w", shapes) for c, g in zip(compressors, grads, strict=True)]
        for _ in range(1, compressors[0].capabilities.rounds):
            total = sum_payloads([p for p, _ in states])
            states = [
                c.next_round(tuple(t.clone() for t in total), ctx)
                for c, (_, ctx) in zip(compressors, states, strict=True)
            ]
        results = aggregate(compressors, [ctx for _, ctx in states], [p for p, _ in states])
        local = sum(c.shares["w"].double() for c in compressors)  # type: ignore[attr-defined]
        for c, result in zip(compressors, results, strict=True):
            assert torch.equal(result, results[0])
            assert torch.equal(c.estimates["w"], result)  # type: ignore[attr-defined]
        torch.testing.assert_close(results[0].double(), local, rtol=1e-5, atol=1e-6)


def test_ef21_estimate_follows_a_constant_gradient() -> None:
    """With a constant gradient, h moves toward it by what each compression carries: G approaches
    the average gradient (classic EF's output would keep oscillating around it)."""
    compressors = [make_compressor("topk:ratio=0.2,ef=ef21", rank=r) for r in range(RANKS)]
    grads = gradients(0)
    for _ in range(40):
        result = averaged(compressors, grads)
    torch.testing.assert_close(result, torch.stack(grads).mean(0), rtol=1e-5, atol=1e-6)


def test_ef21_hands_over_nothing_and_forgets_both_estimates() -> None:
    """EF21's h estimates this rank's share (G their sum): no unsent gradient. take_residual returns
    None (the old way, h added to the next gradient, would send the share about twice) and drops h
    and G of the key on every rank, so the key restarts as a fresh one and G stays the sum of the h."""
    compressors = [make_compressor("topk:ratio=0.2,ef=ef21", rank=r) for r in range(RANKS)]
    for step in range(3):
        averaged(compressors, gradients(step), "w")
        averaged(compressors, gradients(step + 10), "other")
    kept = [c.estimates["other"].clone() for c in compressors]  # type: ignore[attr-defined]
    assert all(c.take_residual("w") is None for c in compressors)
    for c, other in zip(compressors, kept, strict=True):
        assert "w" not in c.shares and "w" not in c.estimates  # type: ignore[attr-defined]
        assert torch.equal(c.estimates["other"], other)  # type: ignore[attr-defined]
    fresh = [make_compressor("topk:ratio=0.2,ef=ef21", rank=r) for r in range(RANKS)]
    assert torch.equal(averaged(compressors, gradients(5), "w"), averaged(fresh, gradients(5), "w"))


# -- state --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "topk:ratio=0.1,ef=true,momentum=0.9,clip=0.5",
        "quantize:bits=2,ef=true,momentum=0.9,nesterov=true",
        "sign:ef=ef21,clip=1",
    ],
)
def test_state_resumes_bitwise(spec: str) -> None:
    """Three steps, a checkpoint through torch.save / torch.load(weights_only=True), three more:
    as the run straight through."""
    straight = [make_compressor(spec, rank=r) for r in range(RANKS)]
    for step in range(6):
        expected = averaged(straight, gradients(step))
    first = [make_compressor(spec, rank=r) for r in range(RANKS)]
    for step in range(3):
        averaged(first, gradients(step))
    resumed = []
    for r, compressor in enumerate(first):
        buffer = io.BytesIO()
        torch.save(compressor.state_dict(), buffer)
        buffer.seek(0)
        fresh = make_compressor(spec, rank=r)
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        resumed.append(fresh)
    for step in range(3, 6):
        result = averaged(resumed, gradients(step))
    assert torch.equal(result, expected)


def test_the_plain_feedback_path_is_unchanged() -> None:
    """ef=true alone keeps the fused path of classic error feedback: bitwise what it gave before
    the options existed (the same as dividing, then adding the residual)."""
    compressor = make_compressor("topk:ratio=0.1,ef=true")
    assert isinstance(compressor, ErrorFeedback) and compressor.feedback == Feedback("classic")
    g = torch.randn(300)
    payload, _ = compressor.compress_divided(g.clone(), 3, "w")
    values, indices = payload
    assert torch.equal(values, (g / 3)[indices.long()])


def test_ratio_schedule_is_dgcs() -> None:
    """DGC's warm-up, per step: with ratio 0.001 over 4 steps, 25%, 6.3%, 1.6%, 0.4%, then 0.1%."""
    ratios = [warmup_ratio(0.001, 4, step) for step in range(6)]
    torch.testing.assert_close(
        torch.tensor(ratios, dtype=torch.float64),
        torch.tensor([0.001 ** (k / 5) for k in (1, 2, 3, 4, 5, 5)], dtype=torch.float64),
    )
    assert abs(ratios[0] - 0.2512) < 1e-4 and abs(ratios[3] - 0.00398) < 1e-5
    assert warmup_ratio(0.01, 0, 0) == 0.01


def test_compress_all_and_feedback_keep_working_together() -> None:
    """The simulator (compress, not compress_divided) runs momentum correction too."""
    compressors = [make_compressor("topk:ratio=1,ef=true,momentum=0.5,mask=false", rank=r) for r in range(2)]
    grads = gradients(0, ranks=2)
    contexts, finals = compress_all(compressors, grads, "w")
    torch.testing.assert_close(aggregate(compressors, contexts, finals)[0], grads[0] + grads[1])


def test_ef21_states_saved_with_h_among_the_residuals_load_as_shares() -> None:
    """Checkpoints written before h had its own name kept it under ``residuals``: they load into
    ``shares`` and continue exactly as the state saved today does."""
    compressors = [make_compressor("sign:ef=ef21", rank=r) for r in range(RANKS)]
    for step in range(3):
        averaged(compressors, gradients(step), "w")
    saved = copy.deepcopy([c.state_dict() for c in compressors])  # states hold the live tensors
    old = copy.deepcopy(
        [
            {
                **{k: v for k, v in s.items() if k != "shares"},
                "residuals": [{"key": e["key"], "residual": e["share"]} for e in s["shares"]],
            }
            for s in saved
        ]
    )
    today = [make_compressor("sign:ef=ef21", rank=r) for r in range(RANKS)]
    before = [make_compressor("sign:ef=ef21", rank=r) for r in range(RANKS)]
    for c, state in zip(today, saved, strict=True):
        c.load_state_dict(state)
    for c, state in zip(before, old, strict=True):
        c.load_state_dict(state)
        assert not c.residuals and set(c.shares) == {"w"}  # type: ignore[attr-defined]
    assert torch.equal(averaged(today, gradients(3), "w"), averaged(before, gradients(3), "w"))
