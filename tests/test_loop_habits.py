"""The training loop's habits with every kind of hook, on 2 gloo ranks: gradient accumulation with
``no_sync()``, ``torch.amp`` with a gradient scaler, ``find_unused_parameters``, ``static_graph``,
parameters frozen midway and ``torch.compile``. Each against uncompressed DDP under the same habit
(bitwise for the lossless hooks), and each lossy hook against itself without the habit: a habit must
not change what a hook computes."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed import Failures, identical_on_all_ranks, run_checks

STEPS = 6
KINDS = [
    "allreduce",  # gradcomp's lossless path
    "topk:ratio=0.2",  # a compressor without error feedback
    "topk:ratio=0.2,ef=true",  # and with it
    "powersgd:rank=2,ef=true",  # two rounds, per-matrix state
    "auto:candidates=topk:ratio=0.2,ef=true,measure_at=2",  # measures, then chooses (at step 2)
    "torch:allreduce",  # torch's own hooks, through gradcomp.hooks.torch_hooks
    "torch:fp16",
]
LOSSLESS = {"allreduce", "torch:allreduce"}
CASTS = {"torch:fp16"}
"""Lossy only in rounding, which a gradient scaler's scale changes where float16 runs out of digits
(its subnormals): under ``amp`` they match themselves without a scaler to float16's precision."""


class Net(nn.Module):
    """The toy MLP; with ``unused``, also a head the loss never uses (DDP then needs
    find_unused_parameters)."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        from tests.toy_ddp import toy_model

        self.body = toy_model()
        self.unused = nn.Linear(10, 10) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def attach(ddp: DistributedDataParallel, hook: str | None) -> Any:
    """``hook`` on ``ddp``: None for DDP's own all-reduce; torch's hooks through gradcomp's wrapper."""
    from gradcomp import hooks
    from gradcomp.hooks import torch_hooks

    if hook is None:
        return None
    return torch_hooks.register(ddp, hook) if hook.startswith("torch:") else hooks.register(ddp, hook)


def train(rank: int, hook: str | None, habit: str, *, summed: bool = False) -> dict[str, Any]:
    """STEPS optimizer steps of the toy model under ``hook`` with ``habit`` (``plain``: none;
    ``autocast``: bf16 autocast without a scaler; ``whole``: DDP's default buckets, as ``compile``
    takes); with ``summed``, accumulation's micro-batches go as one backward of their summed loss."""
    from tests.toy_ddp import BUCKET_CAP_MB, toy_batches

    torch._dynamo.reset()
    net = Net(unused=habit == "find_unused")
    options: dict[str, Any] = {"bucket_cap_mb": None if habit in ("compile", "whole") else BUCKET_CAP_MB}
    if habit in ("find_unused", "frozen"):
        options["find_unused_parameters"] = True
    if habit == "static_graph":
        options["static_graph"] = True
    ddp = DistributedDataParallel(net, **options)
    state = attach(ddp, hook)
    model = torch.compile(ddp, backend="inductor") if habit == "compile" else ddp
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # a constant scale: what a changing one does to error feedback is another matter (docs/reliability.md)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) if habit == "amp" else None
    accumulate = 3 if habit == "no_sync" else 1
    batches = toy_batches(rank, STEPS * accumulate)
    frozen: torch.Tensor | None = None
    for step in range(STEPS):
        if habit == "frozen" and step == 3:  # the first layer stops training
            net.body[0].requires_grad_(False)
            frozen = net.body[0].weight.detach().clone()
        micro = batches[step * accumulate : (step + 1) * accumulate]
        autocast = habit in ("amp", "autocast")
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        if summed:
            with amp:
                losses = [nn.functional.cross_entropy(model(x), y) for x, y in micro]
            torch.stack(losses).sum().backward()
        else:
            for i, (x, y) in enumerate(micro):  # no_sync around forward and backward, as DDP wants
                with contextlib.nullcontext() if i == accumulate - 1 else ddp.no_sync(), amp:
                    loss = nn.functional.cross_entropy(model(x), y)
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in net.body.parameters()]),
        "unused": None if net.unused is None else torch.cat([p.detach().reshape(-1) for p in net.unused.parameters()]),
        "first": net.body[0].weight.detach().clone(),
        "frozen": frozen,
        "steps": len(state.steps()) if state is not None else STEPS,
        # auto's choice and the steps it took it at, which it makes from timings (a loaded machine's
        # probe may not fit: it measures again at the next step, with the same choice a step later)
        "choice": (sorted(getattr(state, "choice", {}).items()), [d["step"] for d in getattr(state, "decisions", [])]),
    }


REFERENCE = {"amp": "autocast", "static_graph": "plain", "compile": "whole"}
"""The habit each lossy hook must match itself under: the same computation without the habit."""


def check_habit(rank: int, world: int, habit: str) -> Failures:
    failures = Failures()
    initial = Net(unused=True)
    start = torch.cat([p.detach().reshape(-1) for p in initial.body.parameters()])
    untouched = torch.cat([p.detach().reshape(-1) for p in initial.unused.parameters()])
    default = train(rank, None, habit)
    moved = float((default["params"] - start).norm())
    for hook in KINDS:
        run = train(rank, hook, habit)
        where = f"{hook}, {habit}"
        failures.expect(identical_on_all_ranks(run["params"]), f"{where}: replicas differ")
        failures.expect(bool(torch.isfinite(run["params"]).all()), f"{where}: non-finite parameters")
        failures.expect(run["steps"] == STEPS, f"{where}: the hook counted {run['steps']} steps, not {STEPS}")
        if run["unused"] is not None:
            failures.expect(torch.equal(run["unused"], untouched), f"{where}: the unused head moved")
        if habit == "frozen":
            failures.expect(torch.equal(run["first"], run["frozen"]), f"{where}: the frozen layer moved")
        if hook in LOSSLESS:
            failures.expect(torch.equal(run["params"], default["params"]), f"{where}: differs from DDP's own")
            continue
        # lossy: it trains as DDP does, closer to DDP's parameters than DDP moved from the start
        off = float((run["params"] - default["params"]).norm())
        failures.expect(off < moved, f"{where}: {off:.3g} from DDP's parameters, which moved {moved:.3g}")
        # the same computation otherwise: auto's only where it made the same choices (timed, they vary)
        if habit == "no_sync":  # error feedback sees the accumulated gradient: as one summed backward
            alike = train(rank, hook, habit, summed=True)
            if alike["choice"] == run["choice"]:
                failures.expect(torch.allclose(run["params"], alike["params"], rtol=1e-4, atol=1e-6),
                                f"{where}: accumulation differs from one backward of the summed loss")  # fmt: skip
        elif habit in REFERENCE:  # the habit does not change what the hook computes
            reference = train(rank, hook, REFERENCE[habit])
            if reference["choice"] != run["choice"]:
                continue
            alone = reference["params"]
            if habit == "compile":  # Inductor's kernels round otherwise than eager ones
                same = torch.allclose(run["params"], alone, rtol=1e-4, atol=1e-6)
            elif habit == "amp" and hook in CASTS:
                same = torch.allclose(run["params"], alone, rtol=1e-3, atol=1e-6)
            else:
                same = torch.equal(run["params"], alone)
            failures.expect(same, f"{where}: differs from the same hook under {REFERENCE[habit]}")
    return failures


@pytest.mark.timeout(280)
@pytest.mark.parametrize("habit", ["no_sync", "amp", "find_unused", "static_graph", "frozen", "compile"])
def test_every_hook_kind_keeps_the_loops_habits(habit: str) -> None:
    run_checks(2, check_habit, (habit,), timeout=260)
