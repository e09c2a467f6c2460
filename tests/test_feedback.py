"""Error feedback conserves exactly, carries nothing across keys, and checkpoints exactly."""

from __future__ import annotations

import io

import pytest
import torch

from gradcomp.compressors import Compressor, make_compressor
from gradcomp.compressors.feedback import ErrorFeedback
from gradcomp.compressors.simulate import compress_all, simulate
from tests.helpers import SPECS, with_feedback

pytestmark = pytest.mark.usefixtures("both_paths")  # the CPU's paths and an accelerator's


def gradients(steps: int, shape: tuple[int, ...] = (40, 30), seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("spec", SPECS)
def test_conservation_is_exact_each_step(spec: str) -> None:
    """g + e_old == contribution + e_new, to float rounding, at every step."""
    ef = make_compressor(with_feedback(spec))
    assert ef.has_feedback
    for g in gradients(4):
        e_old = ef.residuals.get("w", torch.zeros_like(g)).clone()
        contexts, finals = compress_all([ef], [g], key="w")
        contribution = ef.contribution(finals[0], contexts[0])
        e_new = ef.residuals["w"]
        scale = float((g + e_old).abs().max())
        assert torch.allclose(g + e_old, contribution + e_new, rtol=0, atol=1e-6 * scale)


def test_powersgd_fused_residual_conserves_with_uncompressed_pieces() -> None:
    """PowerSGD subtracts its contribution in place (one addmm per matrix); the vectors in the bucket
    travel exactly, so their residual is zero, and contribution() still sees what was sent."""
    ef = make_compressor("powersgd:rank=2,ef=true")
    shapes = [torch.Size([40, 30]), torch.Size([30]), torch.Size([20, 10]), torch.Size([10])]
    for g in gradients(4, shape=(sum(s.numel() for s in shapes),)):
        e_old = ef.residuals.get("b", torch.zeros_like(g)).clone()
        payload, ctx = ef.compress(g, "b", shapes)
        payload, ctx = ef.next_round(payload, ctx)
        e_new = ef.residuals["b"]
        contribution = ef.contribution(payload, ctx)
        assert torch.allclose(g + e_old, contribution + e_new, rtol=0, atol=1e-5)
        assert torch.equal(e_new[1200:1230], torch.zeros(30)) and torch.equal(e_new[-10:], torch.zeros(10))
        assert torch.equal(contribution[1200:1230], (g + e_old)[1200:1230])


def sent_over(ef: Compressor, grads: list[torch.Tensor], also: str | None = None) -> torch.Tensor:
    """What ``ef`` sent of key "w" over one step per gradient (key ``also`` compressed beside it)."""
    sent = torch.zeros_like(grads[0])
    for g in grads:
        contexts, finals = compress_all([ef], [g], key="w")
        sent += ef.contribution(finals[0], contexts[0])
        if also is not None:
            compress_all([ef], [g], key=also)
    return sent


@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.05", "sign:chunk=64", "quantize:bits=2,rounding=nearest", "powersgd:rank=1"]
)
def test_nothing_is_lost_only_delayed(spec: str) -> None:
    """Over T steps, the sum of what was sent plus the last residual is the sum of the gradients."""
    ef = make_compressor(f"{spec},ef=true")
    grads = gradients(20)
    sent = sent_over(ef, grads)
    total = torch.stack(grads).sum(0)
    assert torch.allclose(sent + ef.residuals["w"], total, atol=1e-4)
    # and the residual stays bounded: a few gradients' worth, not a growing share of the sum
    assert ef.residuals["w"].norm() < 5 * torch.stack([g.norm() for g in grads]).mean()


def test_identity_with_feedback_keeps_a_zero_residual() -> None:
    ef = make_compressor("none:ef=true")
    for g in gradients(3):
        compress_all([ef], [g], key="w")
        assert torch.equal(ef.residuals["w"], torch.zeros_like(g))


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "quantize:bits=2,rounding=nearest", "topk:ratio=0.1,momentum=0.9"])
def test_taking_the_residual_hands_over_exactly_what_was_not_sent(spec: str) -> None:
    """take_residual gives the residual itself (sent plus taken is the sum of the gradients) and
    forgets the key: it comes back as a fresh key, other keys untouched."""
    ef = make_compressor(f"{spec},ef=true")
    grads = gradients(4)
    sent = sent_over(ef, grads, also="other")
    residual, other = ef.residuals["w"].clone(), ef.residuals["other"].clone()
    taken = ef.take_residual("w")
    assert taken is not None and torch.equal(taken, residual)
    if "momentum" not in spec:  # momentum correction sends more than the gradients: their momentum
        assert torch.allclose(sent + taken, torch.stack(grads).sum(0), atol=1e-4)
    assert "w" not in ef.residuals and "w" not in ef.velocities and ef.take_residual("w") is None
    assert torch.equal(ef.residuals["other"], other)
    fresh = make_compressor(f"{spec},ef=true")
    compress_all([ef], [grads[0]], key="w")
    compress_all([fresh], [grads[0]], key="w")
    assert torch.equal(ef.residuals["w"], fresh.residuals["w"])


def test_a_compressor_without_feedback_owes_nothing() -> None:
    compressor = make_compressor("topk:ratio=0.1")
    compress_all([compressor], [gradients(1)[0]], key="w")
    assert compressor.take_residual("w") is None


def test_keys_are_independent_and_checked() -> None:
    ef = make_compressor("topk:ratio=0.1,ef=true")
    a, b = gradients(1, (100,))[0], gradients(1, (100,), seed=1)[0]
    compress_all([ef], [a], key="a")
    compress_all([ef], [b], key="b")
    assert set(ef.residuals) == {"a", "b"}
    assert not torch.equal(ef.residuals["a"], ef.residuals["b"])
    with pytest.raises(ValueError, match=r"key 'a' held a torch.float32 residual of shape \(100,\)"):
        ef.compress(torch.randn(50), key="a")
    with pytest.raises(ValueError, match="already has error feedback"):
        ErrorFeedback(ef)


@pytest.mark.parametrize("spec", SPECS)
def test_checkpoint_resumes_exactly(spec: str) -> None:
    """N steps, save, load into a fresh compressor, M more steps == N + M uninterrupted."""
    grads = gradients(6)
    reference = make_compressor(with_feedback(spec), seed=4)
    first = make_compressor(with_feedback(spec), seed=4)
    for g in grads[:3]:
        compress_all([reference], [g], key=("layer", 0))
        compress_all([first], [g], key=("layer", 0))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = make_compressor(with_feedback(spec), seed=4)
    resumed.load_state_dict(state)
    for g in grads[3:]:
        ctx_a, final_a = compress_all([reference], [g], key=("layer", 0))
        ctx_b, final_b = compress_all([resumed], [g], key=("layer", 0))
        for ta, tb in zip(final_a[0], final_b[0], strict=True):
            assert torch.equal(ta, tb)
        assert torch.equal(reference.decompress(final_a[0], ctx_a[0]), resumed.decompress(final_b[0], ctx_b[0]))
    assert torch.equal(reference.residuals[("layer", 0)], resumed.residuals[("layer", 0)])


def test_generator_state_refuses_another_seed() -> None:
    a, b = make_compressor("randomk", seed=1), make_compressor("randomk", seed=2)
    compress_all([a], [torch.randn(100)])
    with pytest.raises(ValueError, match="saved with seed 1"):
        b.load_state_dict(a.state_dict())


def test_a_non_contractive_compressor_makes_the_residual_grow() -> None:
    """Why the docs pair error feedback with contractive (biased) compressors: stochastic 1-bit
    min-max quantization can err by more than the value itself, and the residual then explodes (so
    the spec is refused: test_error_feedback_refuses_compressors_that_are_no_contraction)."""
    ef = ErrorFeedback(make_compressor("quantize:bits=1"))
    grads = gradients(20)
    for g in grads:
        compress_all([ef], [g], key="w")
    assert ef.residuals["w"].norm() > 100 * torch.stack(grads).sum(0).norm()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("quantize:bits=1,ef=true", "sign:ef=true"),
        ("quantize:bits=1,rounding=nearest,ef=true", r"1\.8 \|x\| nearest"),
        ("qsgd:ef=true", r"min\(d / s\^2, sqrt\(d\) / s\) is 3\.23.*chunk < 49"),
        ("qsgd:bits=2,chunk=4,ef=true", "chunk < 1"),
        ("randomk:ratio=0.1,ef=true", "scale=false"),
    ],
)
def test_error_feedback_refuses_compressors_that_are_no_contraction(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        make_compressor(spec)
    make_compressor("quantize:bits=2,ef=true")  # and takes their contractive variants
    make_compressor("qsgd:bits=4,chunk=48,ef=true")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("spec", SPECS)
def test_a_non_finite_step_leaves_the_residual_as_it_was(spec: str, bad: float) -> None:
    """The step with a NaN or Inf carries it (GradScaler sees it and skips the step); the residual
    is bitwise what it was before, so the next step is clean."""
    ef = make_compressor(with_feedback(spec))
    good, poisoned, after = gradients(3)
    compress_all([ef], [good], key="w")
    before = ef.residuals["w"].clone()
    poisoned.view(-1)[17] = bad
    contexts, finals = compress_all([ef], [poisoned], key="w")
    assert not torch.isfinite(ef.decompress(finals[0], contexts[0])).all()  # the step carries it
    assert torch.equal(ef.residuals["w"], before)
    contexts, finals = compress_all([ef], [after], key="w")
    assert torch.isfinite(ef.decompress(finals[0], contexts[0])).all() and torch.isfinite(ef.residuals["w"]).all()


def test_an_overflowing_cast_leaves_the_residual_as_it_was() -> None:
    """fp16 of a finite gradient past 65504 is Inf (GradScaler's overflow): no residual of -Inf."""
    ef = make_compressor("fp16:ef=true")
    compress_all([ef], [torch.ones(10)], key="w")
    before = ef.residuals["w"].clone()
    compress_all([ef], [torch.full((10,), 1e6)], key="w")
    assert torch.equal(ef.residuals["w"], before)


def test_a_peers_nan_leaves_powersgd_memory_and_residuals_as_they_were() -> None:
    """A NaN on one rank reaches every rank through the summed factors: every rank keeps its
    residual and the shared warm-start memory, the same decision everywhere."""
    ranks = [make_compressor("powersgd:rank=2,ef=true", rank=r) for r in range(2)]
    first, second = gradients(2, seed=1), gradients(2, seed=2)
    simulate(ranks, [first[0], second[0]], key="w")
    residuals = [c.residuals["w"].clone() for c in ranks]
    memories = [c.inner.memory["w"].clone() for c in ranks]
    nan = first[1].clone()
    nan[3, 4] = float("nan")
    assert not any(torch.isfinite(result).all() for result in simulate(ranks, [nan, second[1]], key="w"))
    for c, residual, memory in zip(ranks, residuals, memories, strict=True):
        assert torch.equal(c.residuals["w"], residual)
        assert torch.equal(c.inner.memory["w"], memory)


@pytest.mark.parametrize("divisor", [1, 2, 3, 7])
@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("spec", SPECS)
def test_compress_divided_is_bitwise_compress_of_the_quotient(spec: str, ef: bool, divisor: int) -> None:
    """The engine's first step, compress(g / p), folded into one pass by casts and error feedback,
    sends bitwise the same payloads and keeps bitwise the same residuals as dividing first, step after step."""
    text = with_feedback(spec) if ef else spec
    folded, reference = make_compressor(text, seed=5), make_compressor(text, seed=5)
    for g in gradients(3, shape=(60, 50)):
        payload, ctx = folded.compress_divided(g.clone(), divisor, "w")
        expected, expected_ctx = reference.compress(g / divisor, "w")
        for _ in range(1, folded.capabilities.rounds):  # one rank: the aggregate of a round is the payload itself
            payload, ctx = folded.next_round(payload, ctx)
            expected, expected_ctx = reference.next_round(expected, expected_ctx)
        assert len(payload) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(payload, expected, strict=True))
        if ef:
            assert torch.equal(folded.residuals["w"], reference.residuals["w"])


@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.05", "topk:ratio=0.01,method=sampled", "threshold:tau=0.5", "randomk:ratio=0.1,scale=false"]
)
def test_a_fused_sparse_residual_is_bitwise_the_dense_subtraction(spec: str) -> None:
    """Sparsifiers and random-k subtract their contribution at their k elements only: the residual
    is bitwise (g + e) - contribution, computed densely, step after step."""
    ef = make_compressor(f"{spec},ef=true")
    for g in gradients(3, shape=(60, 50)):
        compensated = g + ef.residuals.get("w", torch.zeros_like(g))
        payload, ctx = ef.compress(g, "w")
        assert torch.equal(ef.residuals["w"], compensated - ef.contribution(payload, ctx))
