"""The engine's warm-up on real gloo ranks: uncompressed steps bitwise the all-reduce hook's, the
momentum correction carried through them, and the sparsifiers' ratio schedule, step by step."""

from __future__ import annotations

from typing import Any

import torch

from gradcomp.compressors.sparse import index_dtype, kept
from gradcomp.engine.spec import warmup_ratio
from tests.distributed import Failures, run_checks
from tests.toy_ddp import sgd_steps, toy_batches, toy_model, train, wrap

SPEC = "quantize:bits=2,ef=true,warmup=3"


def warm_up(rank: int, world: int) -> Failures:
    failures = Failures()
    plain, _ = train(rank, "allreduce", 3)
    warm, _ = train(rank, SPEC, 3)
    failures.expect(all(torch.equal(a, b) for a, b in zip(plain, warm, strict=True)), "warm-up differs from allreduce")
    plain, _ = train(rank, "allreduce", 4)
    compressed, _ = train(rank, SPEC, 4)
    failures.expect(
        not all(torch.equal(a, b) for a, b in zip(plain, compressed, strict=True)), "step 4 was not compressed"
    )

    # Momentum correction in warm-up steps: momentum SGD on the averaged gradient, to float rounding
    # (each rank keeps its own velocity; their average is the global one).
    batches = toy_batches(rank, 3)
    reference, _ = wrap(toy_model(), "allreduce")
    sgd_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches)
    corrected, _ = wrap(toy_model(), "quantize:bits=2,ef=true,momentum=0.9,warmup=3")
    sgd_steps(corrected, torch.optim.SGD(corrected.parameters(), lr=0.1), batches)
    close = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(reference.parameters(), corrected.parameters(), strict=True)
    )
    failures.expect(close, "momentum correction's warm-up differs from momentum SGD")
    return failures


def test_warm_up_steps_are_the_allreduce_hooks() -> None:
    run_checks(2, warm_up, timeout=240)


def ratio_schedule(rank: int, world: int) -> dict[str, Any]:
    _, state = train(rank, "topk:ratio=0.01,ef=true,warmup=20", 6)
    assert state is not None
    sizes = [p.numel() for p in toy_model().parameters()]
    _, warmed = train(rank, "topk:ratio=0.01,ef=true,warmup=4", 7)
    _, plain = train(rank, "topk:ratio=0.01,ef=true", 7)
    assert warmed is not None and plain is not None
    return {
        "failures": Failures(),
        "payload": [s.payload_bytes for s in state.steps()],
        "sizes": sizes,
        "sent after warm-up": [s.sent_bytes for s in warmed.steps()][-1],
        "sent without": [s.sent_bytes for s in plain.steps()][-1],
    }


def test_sparsifier_ratio_falls_exponentially_over_the_warm_up() -> None:
    """Step t of a warm-up of 20 is scheduled at 0.01 ** ((t + 1) / 21): 0.80, 0.64, 0.52 (steps a
    top-k payload would carry more bytes than the gradient: sent uncompressed, 4 bytes an element),
    then 0.42, 0.33, 0.27: kept(ratio, n) values and indices per tensor."""
    result = run_checks(2, ratio_schedule, timeout=240)[0]

    def expected(step: int) -> int:
        ratio = warmup_ratio(0.01, 20, step)
        if ratio >= 0.5:
            return sum(4 * n for n in result["sizes"])
        return sum(kept(ratio, n) * (4 + torch.empty(0, dtype=index_dtype(n)).element_size()) for n in result["sizes"])

    assert [warmup_ratio(0.01, 20, step) >= 0.5 for step in range(6)] == [True] * 3 + [False] * 3
    assert result["payload"] == [expected(step) for step in range(6)]
    # After the warm-up, the link carries what it carries without one: the padded all-gather did
    # not keep the warm-up's larger frames.
    assert result["sent after warm-up"] == result["sent without"]
