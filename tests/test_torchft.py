"""gradcomp on torchft's process groups (issue: training that survives a lost replica).

torchft reconfigures one process group in place at every quorum, a group that ``torch.distributed``
does not know; gradcomp's engine runs on it as it is (``Engine(own_group=False)``: no private group
of its ranks, which a dead member would leave broken), its point-to-point exchanges through the
group's own send and receive. Here: that engine averages as the engine on the world group does,
bitwise, for every kind of payload."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import Failures, identical_on_all_ranks, run_checks

pytest.importorskip("torchft")

SPECS = ["allreduce", "fp16", "quantize:bits=4", "sign:ef=true", "topk:ratio=0.1,ef=true",
         "threshold:tau=0.5,ef=true", "powersgd:rank=2,ef=true", "quantize:bits=4,algo=ring"]  # fmt: skip
"""Sums (native and gradcomp's ring: point-to-point), gathers of fixed and of measured sizes, two rounds."""
MEASURED = ["threshold:tau=0.5,ef=true", "topk:ratio=0.1,method=sampled,ef=true"]
"""Payloads sized by their values, on an accelerator's paths: counts gathered, then sizes known."""
SHAPES = [torch.Size(s) for s in [(40, 30), (30,), (64, 16), (7,), (300, 300)]]


def torchft_group(rank: int, world: int, prefix: str) -> Any:
    """A torchft ``ProcessGroupGloo`` of the world's ranks, configured as its ``Manager`` does at a
    quorum (on a store that rank 0 serves): unknown to ``torch.distributed``."""
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    group = ProcessGroupGloo(timeout=datetime.timedelta(seconds=60))
    group.configure(f"localhost:{port[0]}/{prefix}", f"replica{rank}", rank, world)
    group.kept_store = store  # the store lives as long as the group
    return group


def engines_agree(rank: int, world: int) -> list[str]:
    import contextlib

    from gradcomp import host
    from gradcomp.collectives.groups import rank_of, registered, size_of
    from gradcomp.engine import Engine

    group = torchft_group(rank, world, "engines/1")
    failures = Failures()
    # torchft's own rank() answers 0 everywhere: rank_of reads the quorum's group inside it
    failures.expect(not registered(group) and size_of(group) == world and rank_of(group) == rank, "not torchft's group")
    numel = sum(s.numel() for s in SHAPES)
    keys = list(range(len(SHAPES)))
    runs = [(text, False) for text in SPECS] + [(text, True) for text in MEASURED]
    for text, accelerator in runs:
        ours, theirs = Engine(text, group=group, own_group=False), Engine(text)
        with host.as_accelerator() if accelerator else contextlib.nullcontext():
            for step in range(3):
                generator = torch.Generator().manual_seed(100 * rank + step)
                x = torch.randn(numel, generator=generator)
                mine = ours.reduce(x.clone(), keys, SHAPES, 0, True).wait()
                ours.end_step()
                reference = theirs.reduce(x.clone(), keys, SHAPES, 0, True).wait()
                theirs.end_step()
                failures.expect(torch.equal(mine, reference), f"{text}: step {step} differs on torchft's group")
        failures.expect(identical_on_all_ranks(mine), f"{text}: ranks differ")
    return failures


@pytest.mark.timeout(200)
def test_the_engine_runs_on_a_group_torchft_reconfigures_as_on_the_world() -> None:
    run_checks(2, engines_agree, timeout=180)


def test_an_engine_on_a_group_it_does_not_own_makes_no_group_of_its_own() -> None:
    from gradcomp.engine import Engine

    with pytest.raises(ValueError, match="makes no group of its own"):
        Engine("sign:ef=true,local_size=2", group=None, own_group=False)
    with pytest.raises(ValueError, match="makes no group of its own"):
        Engine("sign:ef=true", group=None, own_group=False, timeout=5.0)
