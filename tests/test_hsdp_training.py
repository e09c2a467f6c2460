"""HSDP training runs (``--parallel hsdp``) on 4 real gloo ranks laid out as 2 nodes of 2 (the
launcher's ``LOCAL_WORLD_SIZE``, as torchrun says it): gradcomp's uncompressed all-reduce across
nodes trains bitwise as FSDP2's own HSDP does; 4-bit quantization with error feedback reaches its
accuracy on the digits (within 1 point) with an eighth of the bytes across nodes; a run stopped and
resumed ends bitwise where the run straight through does; a run without nodes, or with a spec that
needs matrices, is refused before any rank starts.

The runs' ranks come from a pool of this module's own, started with the layout set: the session's
pools started without it, and each run would start 4 ranks of its own (4 s a run on 2 cores). Only
the accuracies need :data:`SETTINGS`' 100 steps; the bitwise comparisons run :data:`SHORT`'s 20."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from gradcomp import launch as launcher
from gradcomp.experiments.training import run
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import launch
from gradcomp.hooks import fsdp2
from tests.rank_pool import RankPool
from tests.training_runs import same_checkpoints

pytestmark = pytest.mark.skipif(not fsdp2.available(), reason="this torch has no FSDP2 custom collectives")

SETTINGS: dict[str, Any] = {
    "task": "digits",
    "parallel": "hsdp",
    "steps": 100,
    "batch_size": 64,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "schedule": "cosine",
    "ranks": 4,
    "seed": 1,
    "eval_every": 50,
    "log_every": 10,
    "timeout": 200,
    "group_timeout": 60,
}
SHORT: dict[str, Any] = {**SETTINGS, "steps": 20, "eval_every": 10}
"""The runs compared bitwise: the resumed run stops at :data:`STOP`, and evaluates after it."""
STOP = 8
QUANTIZED = "quantize:bits=4,ef=true"


@pytest.fixture(scope="module")
def nodes() -> Iterator[None]:
    """2 ranks per node, as torchrun says it (the ranks inherit the variable)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_WORLD_SIZE", "2")
        yield


@contextlib.contextmanager
def pooled_on_nodes() -> Iterator[None]:
    """Runs launched inside take their ranks from a pool started here, with the layout :func:`nodes`
    set (as the session's pools do, ``tests/rank_pool.py``: a new pool after a run that failed or left
    its group unhealthy); closed on the way out. A run the pool cannot serve starts ranks of its own."""
    pooled = {"backend": "gloo", "threads": 1, "network": "loopback", "group_timeout": SETTINGS["group_timeout"]}
    pools = [RankPool(SETTINGS["ranks"], SETTINGS["group_timeout"])]

    def spawn(world: int, target: Callable[..., Any], args: Sequence[Any] = (), **options: Any) -> list[Any]:
        timeout = options.pop("timeout", 120.0)
        if world != SETTINGS["ranks"] or any(options.get(key, value) != value for key, value in pooled.items()):
            return launcher.spawn(world, target, args, timeout=timeout, **options)
        if not pools[-1].open:
            pools.append(RankPool(world, SETTINGS["group_timeout"]))
        return pools[-1].run(target, args, timeout)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(run, "spawn", spawn)
            yield
    finally:
        for pool in pools:
            pool.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, nodes: None) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hsdp")
    config = TrainConfig(**SHORT, hook=QUANTIZED, out=str(out / "resumed"), resume="auto")

    def train(name: str, hook: str, settings: dict[str, Any] = SETTINGS) -> dict[str, Any]:
        return launch(TrainConfig(**settings, hook=hook, out=str(out / name)))

    with pooled_on_nodes():
        return {
            "out": out,
            "native": train("native", "torch:reduce_scatter"),
            "quantized": train("quantized", QUANTIZED),
            "native_short": train("native_short", "torch:reduce_scatter", SHORT),
            "allreduce_short": train("allreduce_short", "allreduce", SHORT),
            "quantized_short": train("quantized_short", QUANTIZED, SHORT),
            "stopped": launch(dataclasses.replace(config, stop_at=STOP)),
            "resumed": launch(config),
        }


@pytest.mark.timeout(600)
def test_gradcomps_all_reduce_across_nodes_trains_as_fsdp2s_own_hsdp(runs: dict[str, Any]) -> None:
    native, mine = runs["native_short"]["metrics"], runs["allreduce_short"]["metrics"]
    assert mine["train_loss"] == native["train_loss"] and mine["eval_accuracy"] == native["eval_accuracy"]
    # both count the node's reduce-scatter inside and a ring all-reduce of the shard across nodes
    assert mine["inter_node_bytes"] == native["inter_node_bytes"] > 0


@pytest.mark.timeout(600)
def test_4_bit_across_nodes_reaches_the_uncompressed_accuracy(runs: dict[str, Any]) -> None:
    quantized, exact = runs["quantized"]["metrics"], runs["native"]["metrics"]
    assert exact["eval_accuracy"] > 0.9
    assert quantized["eval_accuracy"] >= exact["eval_accuracy"] - 0.01
    assert quantized["inter_node_bytes"] < exact["inter_node_bytes"] / 6  # 4-bit codes and a scale per chunk


@pytest.mark.timeout(600)
def test_a_resumed_hsdp_run_ends_bitwise_where_the_straight_run_does(runs: dict[str, Any]) -> None:
    assert runs["stopped"]["status"] == "stopped" and runs["resumed"]["resumed_from"] == STOP
    straight = torch.load(runs["out"] / "quantized_short" / "checkpoint.pt", weights_only=True)
    ended = torch.load(runs["out"] / "resumed" / "checkpoint.pt", weights_only=True)
    assert sorted(straight["model"]) == sorted(ended["model"])
    same_checkpoints(straight, ended)
    assert runs["resumed"]["metrics"]["eval_accuracy"] == runs["quantized_short"]["metrics"]["eval_accuracy"]


def test_an_hsdp_run_needs_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="emulated cluster"):
        TrainConfig(**SETTINGS)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="one node; shard them with fsdp"):
        TrainConfig(**SETTINGS)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="divide the world size"):
        TrainConfig(**SETTINGS)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert TrainConfig(**{**SETTINGS, "network": "nodes=2x2,intra=10gbit,inter=100mbit"}).local_size == 2


@pytest.mark.parametrize(
    ("hook", "message"),
    [("powersgd:rank=4", "needs each tensor's shape"), ("auto", "auto chooses"), ("torch:powersgd", "unknown FSDP2")],
)
def test_bad_hsdp_specs_are_refused_before_any_rank_starts(nodes: None, hook: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**SETTINGS, hook=hook)
