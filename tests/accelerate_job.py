"""A 2-process Accelerate job on the CPU for tests/test_accelerate.py, run as ``accelerate launch
--multi_gpu --num_processes 2 -m tests.accelerate_job OUT SPEC STEPS``: the toy model on each rank's own
batches, two micro-batches an optimizer step (``accelerator.accumulate``), gradcomp's hook on the
prepared model, its statistics logged to TensorBoard through ``accelerator.log``, the state saved after
3 steps (OUT/straight/state). Then, in the same processes (a new Accelerator, model, optimizer and hook,
as a script that trains twice makes them: starting Accelerate's processes costs more than the runs),
the run resumed from that state into OUT/resumed. Each rank writes its parameters to
OUT/<run>/rank<r>.pt; rank 0 writes what it logged to OUT/<run>/logged.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from gradcomp.hooks import accelerate as gradcomp_accelerate
from tests.toy_ddp import toy_model

MICRO = 2
SAVE_AFTER = 3


def batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``micro``-th micro-batch (the same in a straight and a resumed run)."""
    generator = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def train(out: Path, spec: str, steps: int, resume: Path | None) -> Accelerator:
    """One run of STEPS optimizer steps into ``out``, from the saved state ``resume`` when given."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO, log_with="tensorboard", project_dir=out)
    accelerator.init_trackers("logs")
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = gradcomp_accelerate.register(accelerator, model, spec)
    statistics = gradcomp_accelerate.Statistics(accelerator, state)
    start = 0
    if resume is not None:
        accelerator.load_state(str(resume))  # the model, the optimizer and every rank's hook state
        start = SAVE_AFTER
    logged = []
    for step in range(start, steps):
        for micro in range(MICRO):
            with accelerator.accumulate(model):
                x, y = batch(accelerator.process_index, step * MICRO + micro)
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        logged.append(statistics.log(step))
        if resume is None and step + 1 == SAVE_AFTER:
            accelerator.save_state(str(out / "state"))
    torch.save([p.detach().clone() for p in model.parameters()], out / f"rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        (out / "logged.json").write_text(json.dumps(logged))
    return accelerator


def main(out: Path, spec: str, steps: int) -> None:
    train(out / "straight", spec, steps, None)
    accelerator = train(out / "resumed", spec, steps, out / "straight" / "state")
    accelerator.end_training()  # which also destroys the process group, as PyTorch documents
    # What this job checks is written; gloo's processes still abort at exit now and then after
    # Accelerate's end_training (1 of about 8 runs here, "terminate called without an active exception",
    # cause not found), which would fail the test on something it does not test: leave without
    # interpreter finalization. gradcomp's own exit is tested in tests/test_executor.py.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
