"""A 2-process Hugging Face Trainer job on the CPU for tests/test_hf_trainer.py, run as ``accelerate launch
--multi_gpu --num_processes 2 -m tests.hf_trainer_job OUT``: a GPT-2 built from a small config (random
weights, nothing downloaded) on random tokens, two micro-batches an optimizer step, in the same
processes one run after another (starting the processes and importing transformers cost more than
the runs):

- ``plain``: DDP's own all-reduce (no callback), 4 steps;
- ``allreduce``: :class:`GradcompCallback` with gradcomp's ``allreduce`` hook, 4 steps;
- ``straight``: ``topk:ratio=0.1,ef=true``, 6 steps, a checkpoint every 3, a log line every step;
- ``resumed``: the same from the straight run's step-3 checkpoint, copied into its own output folder
  and found as ``train(resume_from_checkpoint=True)`` finds it;
- ``adamw``: :class:`CompressedAdamW` (freeze 2, signs with error feedback) through the callback,
  ``optimizers=(optimizer, None)``, clipping at 0.5 (after the freeze: each rank's own gradient), 6 steps,
  and ``adamw_resumed`` from its step-3 checkpoint (past the freeze: the carrier's residuals in it);
- ``recipe``: docs/hooks.md's 10x recipe as written there (``CompressedAdamW(freeze="auto", settle=0.07,
  scaled=True)``, its momentum in 2 bits, the warm-up's hook ``quantize:bits=4``), the Trainer's default
  clipping, RECIPE_STEPS steps: the freeze is measured, not given; and ``recipe_resumed`` from its
  checkpoint at the last check before the freeze (10 steps before it), which must find the freeze at
  the same step.

Each rank writes its parameters to OUT/<run>/rank<r>.pt and its hook's final state to
OUT/<run>/hook<r>.pt; rank 0 of ``straight`` also writes what the Trainer logged (log.json), its hook's
steps (steps.json) and the summaries of the callback and the hook's state (summary.json); rank 0 of each
CompressedAdamW run writes the step it froze at (frozen.json)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradcomp.hooks import CompressedAdamW
from gradcomp.hooks.compressed_adamw_spec import SETTLE_EVERY
from gradcomp.hooks.hf_trainer import GradcompCallback

SPEC = "topk:ratio=0.1,ef=true"
RECIPE_STEPS = 50
"""Long enough for ``freeze="auto"`` to find the variance settled (it compares every 10 steps; at step 40
here) and to compress after it."""


def recipe(model: GPT2LMHeadModel) -> CompressedAdamW:
    """docs/hooks.md's 10x recipe ("Which method under AdamW"), as a user copies it."""
    return CompressedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, freeze="auto", settle=0.07, scaled=True,
                           carrier="quantize:bits=2,rounding=nearest,ef=true")  # fmt: skip


def signs(model: GPT2LMHeadModel) -> CompressedAdamW:
    """A short freeze (2 steps) and signs with error feedback: past the freeze in a few steps."""
    return CompressedAdamW(model.parameters(), lr=1e-3, freeze=2, carrier="sign:ef=true")


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """48 sequences of 16 random tokens, the same in every run (the Trainer shards and shuffles them)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def train(
    out: Path,
    spec: str | None,
    steps: int,
    resume: bool = False,
    adamw: Callable[[GPT2LMHeadModel], CompressedAdamW] | None = None,
    save_steps: int = 3,
    max_grad_norm: float = 1.0,
) -> GradcompCallback | None:
    """One run into ``out``: a Trainer as a user makes one, with the callback unless ``spec`` is None,
    and ``adamw``'s optimizer as the Trainer's where given."""
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, ddp_backend="gloo", max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        save_steps=save_steps, report_to="none", disable_tqdm=True, seed=0, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    model = gpt2()
    optimizer = adamw(model) if adamw is not None else None
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(optimizer, None))
    callback = None
    if spec is not None:
        callback = GradcompCallback(trainer, spec)
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume or None)
    rank = dist.get_rank()
    torch.save([p.detach().clone() for p in model.parameters()], out / f"rank{rank}.pt")
    if callback is not None:
        assert callback.state is not None, "the hook is registered with two processes"
        torch.save(callback.state.state_dict(), out / f"hook{rank}.pt")
        if rank == 0 and out.name == "straight":
            (out / "log.json").write_text(json.dumps(trainer.state.log_history))
            steps: list[dict[str, Any]] = [step.to_dict() for step in callback.state.steps()]
            (out / "steps.json").write_text(json.dumps(steps))
            summaries = {"callback": callback.summary().to_dict(), "state": callback.state.summary().to_dict()}
            (out / "summary.json").write_text(json.dumps(summaries))
        if optimizer is not None:
            assert optimizer.compressing, "past the freeze"
            if rank == 0:
                (out / "frozen.json").write_text(json.dumps({"frozen_at": optimizer.frozen_at}))
    return callback


def copy_checkpoint(run: Path, resumed: Path, step: int = 3) -> None:
    """``run``'s checkpoint of ``step`` into ``resumed``, where a resumed run of its own finds it."""
    if dist.get_rank() == 0:
        shutil.copytree(run / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
    dist.barrier()


def main(out: Path) -> None:
    train(out / "plain", None, 4)
    train(out / "allreduce", "allreduce", 4)
    train(out / "straight", SPEC, 6)
    copy_checkpoint(out / "straight", out / "resumed")
    train(out / "resumed", SPEC, 6, resume=True)
    train(out / "adamw", "allreduce", 6, adamw=signs, max_grad_norm=0.5)
    copy_checkpoint(out / "adamw", out / "adamw_resumed")
    train(out / "adamw_resumed", "allreduce", 6, resume=True, adamw=signs, max_grad_norm=0.5)
    train(out / "recipe", "quantize:bits=4", RECIPE_STEPS, adamw=recipe, save_steps=SETTLE_EVERY)
    dist.barrier()  # rank 0 wrote frozen.json
    # the check before the freeze: its snapshot of the variance, in that checkpoint, decides the freeze
    last_check = json.loads((out / "recipe" / "frozen.json").read_text())["frozen_at"] - SETTLE_EVERY
    copy_checkpoint(out / "recipe", out / "recipe_resumed", step=last_check)
    train(out / "recipe_resumed", "quantize:bits=4", RECIPE_STEPS, resume=True, adamw=recipe, save_steps=SETTLE_EVERY)
    dist.destroy_process_group()
    # What this job checks is written; gloo's processes abort at exit now and then ("terminate called
    # without an active exception", docs/reliability.md): leave without interpreter finalization.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
