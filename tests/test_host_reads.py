"""Host reads in the step (each one a GPU synchronization on a device): every read a gradcomp hook
makes in steady state goes through :mod:`gradcomp.host`, and the statistics count exactly those;
on an accelerator's paths (:func:`gradcomp.host.as_accelerator`) a fixed-size payload reads
nothing, and a variable-size one what its sizes need. Real 2-rank DDP steps of a model with a
layer large enough for top-k's sampled prefilter, audited in every thread (``tests/host_reads.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import Failures, run_checks

FIXED = [
    "allreduce", "fp16", "bf16", "fp8", "quantize:bits=4", "quantize:bits=2,ef=true,momentum=0.9", "qsgd",
    "terngrad", "sign:ef=true", "sign:ef=ef21", "topk:ratio=0.1,ef=true",
    "topk:ratio=0.1,ef=true,momentum=0.9,mask=true", "randomk:ratio=0.1,scale=false,ef=true",
    "powersgd:rank=2,ef=true", "powersgd:rank=1", "fp16:algo=ring", "qsgd:algo=ring",
]  # fmt: skip
"""Payloads whose size the tensor alone decides: every compressor kind, with and without error
feedback and momentum correction, on the backend's collectives and on gradcomp's own."""
VARIABLE = {
    "topk:ratio=0.1,method=sampled,ef=true": 1,
    "threshold:tau=0.01,ef=true": 1,
    "threshold:tau=0.01": 1,
    "topk:ratio=0.1,ef=true,aggregation=two_phase": 2,
}
"""Payloads whose size depends on the values, and the reads per bucket their sizes cost: one for
every rank's sizes (two for two-phase: its all-to-all's, then its all-gather's)."""
WARM, AUDITED = 3, 2
"""Steps before the audit (the first checks specs across ranks and sizes the payloads), and audited."""


def audit_model() -> nn.Module:
    """A first layer of 81920 weights: past top-k's size for its sampled prefilter."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 2048), nn.ReLU(), nn.Linear(2048, 10))


def audited_reads(rank: int, world: int, accelerator: bool) -> dict[str, Any]:
    import contextlib

    from gradcomp import host
    from tests.host_reads import audit
    from tests.toy_ddp import wrap

    failures, per_bucket = Failures(), {}
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(16, 40, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(WARM + AUDITED)]  # fmt: skip
    with host.as_accelerator() if accelerator else contextlib.nullcontext():
        for text in [*FIXED, *VARIABLE]:
            ddp, state = wrap(audit_model(), text, bucket_cap_mb=0.1)
            assert state is not None
            for x, y in batches[:WARM]:
                F.cross_entropy(ddp(x), y).backward()
            with audit() as found:
                for x, y in batches[WARM:]:
                    F.cross_entropy(ddp(x), y).backward()
            steps = state.steps_since(WARM)
            counted = sum(step.host_reads or 0 for step in steps)
            failures.expect(not found.ungated, f"{text}: reads around gradcomp.host: {sorted(set(found.ungated))}")
            failures.expect(found.gated == counted, f"{text}: {found.gated} reads made, {counted} in the statistics")
            per_bucket[text] = counted / sum(step.buckets or 0 for step in steps)
    return {"failures": failures, "per_bucket": per_bucket}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
def test_every_host_read_in_the_step_goes_through_the_gate_and_is_counted(accelerator: bool) -> None:
    results = run_checks(2, audited_reads, (accelerator,), timeout=200)
    per_bucket = results[0]["per_bucket"]
    assert all(per_bucket[text] == 0 for text in ("allreduce", "fp16", "bf16"))  # casts read nothing
    if accelerator:
        assert {text: per_bucket[text] for text in FIXED if per_bucket[text]} == {}
        assert {text: reads for text, reads in per_bucket.items() if reads > VARIABLE.get(text, 0)} == {}
    else:  # on the CPU, exact top-k's prefilter counts its candidates on the host: reads are free there
        assert per_bucket["topk:ratio=0.1,ef=true"] > 0


PATHS_AGREE = ["threshold:tau=0.01,ef=true", "threshold:tau=0.01", "topk:ratio=0.1,method=sampled,ef=true",
               "topk:ratio=0.1,ef=true", "quantize:bits=2,ef=true,momentum=0.9", "powersgd:rank=2,ef=true",
               "qsgd"]  # fmt: skip
"""Specs whose two paths compute the same numbers (sign's mean differs in its last bit: float64 there)."""


def both_paths_trained(rank: int, world: int) -> list[str]:
    import contextlib

    from gradcomp import host
    from tests.distributed import identical_on_all_ranks
    from tests.toy_ddp import wrap

    failures = Failures()
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(16, 40, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(4)]  # fmt: skip
    for text in [*PATHS_AGREE, "sign:ef=true"]:
        finals = []
        for accelerator in (False, True):
            ddp, _ = wrap(audit_model(), text, bucket_cap_mb=0.1)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            with host.as_accelerator() if accelerator else contextlib.nullcontext():
                for x, y in batches:
                    optimizer.zero_grad()
                    F.cross_entropy(ddp(x), y).backward()
                    optimizer.step()
            finals.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
        cpu, accelerator_ = finals
        same = torch.equal(cpu, accelerator_) if text in PATHS_AGREE else torch.allclose(cpu, accelerator_, atol=1e-6)
        failures.expect(same, f"{text}: the accelerator's paths trained elsewhere")
        failures.expect(identical_on_all_ranks(accelerator_), f"{text}: replicas differ on the accelerator's paths")
    return failures


@pytest.mark.timeout(240)
def test_the_accelerators_paths_train_as_the_cpus() -> None:
    """Measured payloads (sized by one read per bucket) and masked commits give the parameters the
    CPU's paths give, bitwise, and the replicas stay identical."""
    run_checks(2, both_paths_trained, timeout=200)
