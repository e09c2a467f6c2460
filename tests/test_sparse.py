"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) under DDP:
``allreduce`` and the casts average them bitwise as DDP's default does; every other spec, ``auto``
included, is refused at registration in one line that says "sparse" and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from tests.distributed import Failures, run_checks

AVERAGED = ["allreduce", "fp16", "bf16", "allreduce:algo=ring"]
REFUSED = ["topk:ratio=0.1", "fp16:ef=true", "powersgd:rank=2", "auto"]


class Tagger(nn.Module):
    """An embedding and an embedding bag with sparse gradients, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.words = nn.Embedding(50, 8, sparse=True)
        self.bag = nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, words: torch.Tensor, bag: torch.Tensor) -> torch.Tensor:
        return self.head(self.words(words).mean(dim=1) + self.bag(bag))


def trained(rank: int, spec: str | None, steps: int = 3) -> list[torch.Tensor]:
    """The parameters after ``steps`` SGD steps (rank-dependent batches, rows repeated within and
    across ranks), under DDP's default (``spec`` None) or the gradcomp hook ``spec``."""
    ddp = DistributedDataParallel(Tagger(), bucket_cap_mb=0.0001)  # one bucket per parameter
    if spec is not None:
        hooks.register(ddp, spec)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):
        words = torch.randint(0, 20, (6, 5), generator=generator)
        bag = torch.randint(0, 10, (6, 3), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(words, bag), torch.randint(0, 4, (6,), generator=generator)).backward()
        optimizer.step()
    return [p.detach().clone() for p in ddp.parameters()]


def sparse_ranks(rank: int, world: int) -> Failures:
    failures = Failures()
    default = trained(rank, None)
    first = trained(rank, None, steps=1)
    for spec in AVERAGED:
        if spec.startswith("allreduce"):  # bitwise DDP's default, step after step
            same = [torch.equal(a, b) for a, b in zip(default, trained(rank, spec), strict=True)]
            failures.expect(all(same), f"{spec}: parameters differ from DDP's default: {same}")
            continue
        # a cast: the sparse weights bitwise (sent as they are), the dense head through the cast (its
        # rounding then reaches the embeddings' later gradients: one step compared)
        ours = trained(rank, spec, steps=1)
        same = [torch.equal(a, b) for a, b in zip(first, ours, strict=True)]
        failures.expect(same[:2] == [True, True], f"{spec}: the embeddings differ from DDP's default")
        close = all(torch.allclose(a, b, atol=1e-2) for a, b in zip(first, ours, strict=True))
        failures.expect(close, f"{spec}: the head is not close to DDP's default")
    for spec in REFUSED:
        try:
            hooks.register(DistributedDataParallel(Tagger()), spec)
            failures.expect(False, f"{spec}: registered on a model with sparse gradients")
        except ValueError as error:
            text = str(error)
            failures.expect(
                "sparse" in text and "'allreduce'" in text and "'words'" in text and "\n" not in text, f"{spec}: {text}"
            )
    # made apart from the model (hooks.make, then DDP's register_comm_hook): refused at the first
    # sparse bucket, with the same line, raised by DDP's backward (before anything is sent)
    ddp = DistributedDataParallel(Tagger(), bucket_cap_mb=0.0001)
    state, hook = hooks.make("topk:ratio=0.1")
    ddp.register_comm_hook(state, hook)
    try:
        ddp(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)).sum().backward()
        failures.expect(False, "topk made apart: a sparse bucket was averaged")
    except ValueError as error:
        failures.expect("sparse" in str(error) and "'allreduce'" in str(error), f"made apart: {error}")
    return failures


def test_allreduce_and_casts_average_sparse_gradients_as_ddp_and_compressors_are_refused() -> None:
    run_checks(2, sparse_ranks, timeout=120)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "quantize:bits=4", "sign:ef=ef21"])
def test_the_refusal_names_the_modules_and_what_to_do(spec: str) -> None:
    from gradcomp.hooks.ddp import refuse_sparse

    named = r"\(nn.Embedding\(sparse=True\) at 'words', nn.EmbeddingBag\(sparse=True\) at 'bag'\)"
    with pytest.raises(ValueError, match=rf"sparse gradients {named}.*Use 'allreduce'.*sparse=False"):
        refuse_sparse(Tagger(), hooks.parse(spec))
    for fine in ["allreduce", "fp16", "bf16", "noop"]:
        refuse_sparse(Tagger(), hooks.parse(fine))
    refuse_sparse(nn.Embedding(5, 2), hooks.parse(spec))  # dense: nothing to refuse
