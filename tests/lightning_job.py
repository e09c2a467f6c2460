"""A 2-process Lightning job on the CPU for tests/test_lightning.py, run as ``python -m tests.lightning_job
OUT STEPS RUN...`` (Lightning starts the second process with the same command), each RUN a SPEC or
``SPEC@resumed``, run one after the other in the same processes into OUT/<its index>: the toy model
on each rank's own random batches (3 an epoch, the same every epoch), gradcomp's hook through
GradcompStrategy (SPEC a hook spec or ``auto``), gradcomp's reduce-scatter under FSDP2
(``fsdp:<sharded spec>``), or with a sync spec (``diloco:...``, ``localsgd:...``) no hook and the
Synchronize callback (outer gradients as 4-bit codes with error feedback); statistics logged to a CSV
logger, a checkpoint at every epoch's end (straight/epoch<e>.ckpt); each rank writes its parameters
to straight/rank<r>.pt. With ``@resumed``, a second run in the same processes (a new Trainer, model
and strategy, as a script that fits twice makes them; the process group is Lightning's to reuse)
resumes from the first one's checkpoint of its first epoch's end into resumed/. Starting Lightning's
processes costs more than the runs: one job serves every test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from gradcomp.hooks.lightning import GradcompModelParallelStrategy, GradcompStrategy, HookStatistics, Synchronize
from tests.toy_ddp import toy_model


class Toy(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = toy_model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # momentum: a per-parameter state (ModelParallelStrategy cannot load an optimizer without one)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ShardedToy(Toy):
    """The toy model sharded with FSDP2 over the data-parallel ranks (ModelParallelStrategy's mesh)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


EPOCH = 3
"""Batches an epoch: a run stopped at an epoch's end resumes with the batches the straight run takes."""


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches of an epoch (seeded by its rank: what the hook averages differs across ranks)."""
    generator = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    return [(torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
            for _ in range(EPOCH)]  # fmt: skip


def strategy(spec: str) -> L.pytorch.strategies.Strategy:
    """SPEC's strategy: ``fsdp:<sharded spec>`` gradcomp's reduce-scatter under FSDP2, ``fsdp``
    FSDP2's own; a sync spec no hook (Synchronize synchronizes); else the DDP hook SPEC."""
    if spec.partition(":")[0] == "fsdp":
        options = {"data_parallel_size": 2, "tensor_parallel_size": 1, "process_group_backend": "gloo",
                   "save_distributed_checkpoint": False}  # fmt: skip
        if spec == "fsdp":
            return L.pytorch.strategies.ModelParallelStrategy(**options)
        return GradcompModelParallelStrategy(spec.partition(":")[2], **options)
    return GradcompStrategy("noop" if synchronizes(spec) else spec, process_group_backend="gloo")


def synchronizes(spec: str) -> bool:
    return spec.startswith(("diloco", "localsgd"))


def fit(out: Path, spec: str, steps: int, resume: Path | None) -> None:
    """One run of STEPS steps into ``out``, from the checkpoint ``resume`` when given."""
    torch.manual_seed(0)
    model = ShardedToy() if spec.startswith("fsdp") else Toy()
    averaging = Synchronize(spec, "quantize:bits=4,ef=true") if synchronizes(spec) else HookStatistics()
    callbacks = [] if spec == "fsdp" else [averaging]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(spec),
        max_steps=steps, logger=CSVLogger(out, name="logs", version=0), log_every_n_steps=1,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=out, filename="epoch{epoch}", save_top_k=-1,
                                                save_on_train_epoch_end=True, auto_insert_metric_name=False)],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(_Batches(), batch_size=None)
    trainer.fit(model, loader, ckpt_path=resume)
    rank = trainer.global_rank
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # FSDP2's shards
    torch.save([p.detach().clone() for p in full], out / f"rank{rank}.pt")


def main(out: Path, steps: int, runs: list[str]) -> None:
    for index, run in enumerate(runs):
        spec, _, resumed = run.partition("@")
        fit(out / str(index) / "straight", spec, steps, None)
        if resumed:
            fit(out / str(index) / "resumed", spec, steps, out / str(index) / "straight" / "epoch0.ckpt")
    # as PyTorch documents: without it a process with gloo groups can abort at exit (std::terminate)
    torch.distributed.destroy_process_group()


class _Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(batches())


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
