"""Host reads in the step (each one a GPU synchronization on a device): every read a gradcomp hook
makes in steady state goes through :mod:`gradcomp.host`, and the statistics count exactly those.
Real 2-rank DDP steps of the toy model, audited in every thread (``tests/host_reads.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn.functional as F

from tests.distributed import Failures, run_checks

SPECS = [
    "allreduce", "fp16", "bf16", "fp8", "quantize:bits=4", "quantize:bits=2,ef=true,momentum=0.9", "qsgd",
    "terngrad", "sign:ef=true", "topk:ratio=0.1,ef=true", "topk:ratio=0.1,method=sampled,ef=true",
    "randomk:ratio=0.1,scale=false,ef=true", "threshold:tau=0.01,ef=true", "powersgd:rank=2,ef=true",
    "fp16:algo=ring", "topk:ratio=0.1,ef=true,aggregation=two_phase",
]  # fmt: skip
"""Every compressor, with and without error feedback, on the backend's collectives and on gradcomp's own."""
WARM, AUDITED = 3, 2
"""Steps before the audit (the first checks specs across ranks and sizes the payloads), and audited."""


def audited_reads(rank: int, world: int) -> dict[str, Any]:
    from tests.host_reads import audit
    from tests.toy_ddp import toy_batches, toy_model, wrap

    failures, per_step = Failures(), {}
    for text in SPECS:
        ddp, state = wrap(toy_model(), text)
        assert state is not None
        batches = toy_batches(rank, WARM + AUDITED)
        for x, y in batches[:WARM]:
            F.cross_entropy(ddp(x), y).backward()
        with audit() as found:
            for x, y in batches[WARM:]:
                F.cross_entropy(ddp(x), y).backward()
        counted = sum(step.host_reads or 0 for step in state.steps_since(WARM))
        failures.expect(not found.ungated, f"{text}: reads around gradcomp.host: {sorted(set(found.ungated))}")
        failures.expect(found.gated == counted, f"{text}: {found.gated} reads made, {counted} in the statistics")
        per_step[text] = counted / AUDITED
    return {"failures": failures, "per_step": per_step}


@pytest.mark.timeout(180)
def test_every_host_read_in_the_step_goes_through_the_gate_and_is_counted() -> None:
    results = run_checks(2, audited_reads, timeout=150)
    per_step = results[0]["per_step"]
    assert all(per_step[text] == 0 for text in ("allreduce", "fp16", "bf16"))  # casts read nothing
