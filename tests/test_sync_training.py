"""Training runs with infrequent synchronization (``--sync``): real 2-rank runs of Streaming DiLoCo on
the digits, stopped with a synchronization in flight and resumed bitwise; what the run records; the
settings refused; sweeps and reports that name the methods."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from gradcomp.experiments.report.analysis import short_name
from gradcomp.experiments.sweep import plan
from gradcomp.experiments.training.config import TrainConfig, method
from gradcomp.experiments.training.run import launch
from tests.training_runs import same_checkpoints, scalars, tensors

STOP = 13
SETTINGS: dict[str, Any] = {
    "task": "digits",
    "steps": 24,
    "batch_size": 32,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "sync": "diloco:every=6,fragments=2,delay=2",  # starts at steps 3, 6, 9, 12, ...: one in flight at 13
    "hook": "quantize:bits=4,ef=true",
    "ranks": 2,
    "seed": 5,
    "eval_every": 6,
    "log_every": 3,
    "timeout": 120,
    "group_timeout": 60,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run straight through, and the same run stopped at STOP and resumed."""
    root = tmp_path_factory.mktemp("sync-runs")
    straight = TrainConfig(**SETTINGS, out=str(root / "straight"))
    resumed = TrainConfig(**SETTINGS, out=str(root / "resumed"), resume="auto")
    stopped = launch(dataclasses.replace(resumed, stop_at=STOP))
    return {
        "straight": launch(straight),
        "stopped": stopped,
        "resumed": launch(resumed),
        "straight_checkpoint": torch.load(straight.checkpoint_path, weights_only=True),
        "resumed_checkpoint": torch.load(resumed.checkpoint_path, weights_only=True),
        "out": root,
    }


@pytest.mark.timeout(240)
def test_a_stopped_and_resumed_diloco_run_ends_bitwise_where_the_straight_run_does(runs: dict[str, Any]) -> None:
    assert runs["stopped"]["status"] == "stopped" and runs["resumed"]["status"] == "finished"
    straight, ended = runs["straight_checkpoint"], runs["resumed_checkpoint"]
    assert len(straight["model"]["replicas"]) == 2  # every rank's own replica
    for part in ("model", "optimizer", "hooks"):
        pairs = zip(tensors(straight[part]), tensors(ended[part]), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), part
    assert ended["progress"]["wire_bytes"] == straight["progress"]["wire_bytes"]
    assert runs["resumed"]["metrics"]["eval_accuracy"] == runs["straight"]["metrics"]["eval_accuracy"]


@pytest.mark.timeout(240)
def test_a_diloco_run_records_what_it_sent_and_waited(runs: dict[str, Any]) -> None:
    metrics = runs["straight"]["metrics"]
    hook = runs["straight_checkpoint"]["hooks"][0]
    assert hook["sync"] == "diloco:every=6,fragments=2,delay=2" and hook["steps_done"] == 24
    assert metrics["compression_ratio"] > 6  # 4-bit codes of float32 outer gradients
    assert metrics["sync_ms"] is not None and metrics["exposed_ms"] is not None
    events = scalars(runs["out"] / "straight")
    sent = [e.value for e in events.Scalars("comm/sent_bytes_per_step")]
    # counted when they land: the first, started at step 3, lands at step 5; every later window holds one
    assert sent[0] == 0 and len(sent) == 8 and all(value > 0 for value in sent[1:]), sent
    assert runs["straight"]["config"]["sync"] == SETTINGS["sync"]


LOCAL_ADAMW: dict[str, Any] = {
    **SETTINGS, "optimizer": "adamw", "momentum": 0.0, "lr": 0.003, "steps": 12, "eval_every": 4,
    "sync": "localsgd:every=4", "hook": "sign:ef=true",
}  # fmt: skip
"""Local AdamW, its outer gradients in signs with error feedback (docs/hooks.md, "AdamW")."""


@pytest.mark.timeout(240)
def test_local_adamw_in_signs_lands_every_replica_on_one_model_and_resumes_bitwise(tmp_path: Path) -> None:
    straight = TrainConfig(**LOCAL_ADAMW, out=str(tmp_path / "straight"))
    resumed = TrainConfig(**LOCAL_ADAMW, out=str(tmp_path / "resumed"), resume="auto")
    launch(straight)
    assert launch(dataclasses.replace(resumed, stop_at=6))["status"] == "stopped"  # between two synchronizations
    assert launch(resumed)["status"] == "finished"
    ended = torch.load(straight.checkpoint_path, weights_only=True)
    replicas = [tensors(replica) for replica in ended["model"]["replicas"]]
    assert all(torch.equal(a, b) for a, b in zip(*replicas, strict=True))  # step 12 synchronized them
    optimizers = [tensors(state) for state in ended["optimizer"]["replicas"]]
    assert not all(torch.equal(a, b) for a, b in zip(*optimizers, strict=True))  # each rank's own AdamW moments
    again = torch.load(resumed.checkpoint_path, weights_only=True)
    for part in ("model", "optimizer", "hooks"):
        pairs = zip(tensors(ended[part]), tensors(again[part]), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), part

ACROSS_NODES = {**SETTINGS, "ranks": 4, "steps": 10, "sync": "diloco:every=4,local_size=2", "eval_every": 5}
"""4 ranks as 2 nodes of 2, DiLoCo across the nodes every 4 steps."""


def straight_and_resumed(settings: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The run of ``settings`` straight through, and again stopped at step 6 and resumed: the
    straight run's checkpoint, after checking that the resumed one holds bitwise the same."""
    straight = TrainConfig(**settings, out=str(tmp_path / "straight"))
    resumed = TrainConfig(**settings, out=str(tmp_path / "resumed"), resume="auto")
    launch(straight)
    assert launch(dataclasses.replace(resumed, stop_at=6))["status"] == "stopped"
    assert launch(resumed)["status"] == "finished"
    ended = torch.load(straight.checkpoint_path, weights_only=True)
    same_checkpoints(ended, torch.load(resumed.checkpoint_path, weights_only=True))
    return ended


@pytest.mark.timeout(240)
def test_diloco_across_nodes_keeps_a_node_replica_and_resumes_bitwise(tmp_path: Path) -> None:
    """``local_size=2`` at 4 ranks: DDP inside each node of 2, DiLoCo across the nodes; between two
    synchronizations a node's ranks hold one replica and the nodes differ; a resumed run ends where
    the straight one does."""
    ended = straight_and_resumed(ACROSS_NODES, tmp_path)
    replicas = [tensors(replica) for replica in ended["model"]["replicas"]]
    same = [all(torch.equal(a, b) for a, b in zip(replicas[0], other, strict=True)) for other in replicas]
    assert same == [True, True, False, False], "a node's ranks share a replica; nodes differ since step 8"


@pytest.mark.timeout(240)
def test_diloco_across_nodes_with_fsdp2_inside_shards_a_node_replica_and_resumes_bitwise(tmp_path: Path) -> None:
    """``local_size=2`` at 4 ranks with FSDP2 inside each node: each rank synchronizes its shard of the
    node's replica with the ranks holding it in the other nodes. With outer gradients uncompressed it
    trains as DDP inside the node does (one node's ranks average the same gradients); checkpoints hold
    each node's whole replica, the nodes differing between synchronizations; a resumed run ends where
    the straight one does."""
    sharded = {**ACROSS_NODES, "parallel": "fsdp"}
    ended = straight_and_resumed(sharded, tmp_path)
    replicas = ended["model"]["replicas"]
    assert [bool(replica) for replica in replicas] == [True, False, True, False], "a node's replica on its first rank"
    assert not all(torch.equal(a, b) for a, b in zip(tensors(replicas[0]), tensors(replicas[2]), strict=True))

    exact = {"hook": "allreduce", "steps": 8}
    fsdp_inside = TrainConfig(**{**sharded, **exact}, out=str(tmp_path / "fsdp"))
    ddp_inside = TrainConfig(**{**ACROSS_NODES, **exact}, out=str(tmp_path / "ddp"))
    launch(fsdp_inside)
    launch(ddp_inside)
    by_fsdp = torch.load(fsdp_inside.checkpoint_path, weights_only=True)["model"]["replicas"][0]
    by_ddp = torch.load(ddp_inside.checkpoint_path, weights_only=True)["model"]["replicas"][0]
    for name, tensor in by_ddp.items():
        assert torch.allclose(by_fsdp[name], tensor, rtol=1e-5, atol=1e-6), name


def test_a_synchronized_run_takes_a_gradcomp_spec_and_replicas() -> None:
    base = {**SETTINGS, "steps": 10}
    for hook in ("torch:allreduce", "auto", "noop"):
        with pytest.raises(ValueError, match=f"the outer gradients travel by .*; {hook} averages every step"):
            TrainConfig(**{**base, "hook": hook})
    with pytest.raises(ValueError, match="with local_size=L\\); not parallel fsdp"):
        TrainConfig(**{**base, "parallel": "fsdp", "hook": "allreduce"})
    with pytest.raises(ValueError, match="not parallel hsdp"):
        TrainConfig(**{**base, "parallel": "hsdp", "hook": "allreduce", "network": "nodes=1x2,inter=1gbit"})
    with pytest.raises(ValueError, match=r"sync 'fedavg': unknown synchronization 'fedavg'; valid: localsgd, diloco"):
        TrainConfig(**{**base, "sync": "fedavg"})
    assert TrainConfig(**{**base, "sync": "diloco:every=6,outer_lr=0.7"}).effective.sync == "diloco:every=6"
    with pytest.raises(ValueError, match="divide the world size 2, got 4"):
        TrainConfig(**{**base, "sync": "diloco:every=6,local_size=4"})


def test_methods_are_named_by_their_sync_and_hook() -> None:
    assert method({"hook": "fp16", "sync": "none"}) == "fp16"
    assert method({"hook": "fp16"}) == "fp16"  # runs made before sync existed
    text = method(TrainConfig(**SETTINGS).to_dict())
    assert text == "diloco:every=6,fragments=2,delay=2 over quantize:chunk=1024,bits=4,rounding=stochastic,ef=true"
    assert short_name(text) == "diloco:every=6,fragments=2,delay=2 over quantize:bits=4,ef=true"


SWEEP = """
[sweep]
task = "digits"
steps = 12
batch_size = 32

[grid]
hooks = ["allreduce"]

[[tasks]]
name = "digits"
hooks = ["torch:allreduce", "fp16"]

[[tasks]]
name = "digits"
syncs = ["localsgd:every=4", "diloco:every=6"]
hooks = ["allreduce", "quantize:bits=4,ef=true"]
"""


def test_a_sweep_compares_synchronized_runs_beside_the_hooks(tmp_path: Path) -> None:
    (tmp_path / "sweep.toml").write_text(SWEEP)
    runs = plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))
    assert [run.name for run in runs] == [
        "digits_torch-allreduce_p2_loopback_seed0",
        "digits_fp16_p2_loopback_seed0",
        "digits_localsgd-every=4_allreduce_p2_loopback_seed0",
        "digits_localsgd-every=4_quantize-chunk=1024-bits=4-rounding=stochastic-ef=true_p2_loopback_seed0",
        "digits_diloco-every=6_allreduce_p2_loopback_seed0",
        "digits_diloco-every=6_quantize-chunk=1024-bits=4-rounding=stochastic-ef=true_p2_loopback_seed0",
    ]
    assert {run.label for run in runs} == {"digits"}  # one group in the report
    (tmp_path / "bad.toml").write_text(SWEEP.replace('"allreduce", "quantize', '"torch:fp16", "quantize'))
    with pytest.raises(ValueError, match="torch:fp16 averages every step"):
        plan.load(str(tmp_path / "bad.toml"), str(tmp_path / "out"))


CONVERGENCE: dict[str, Any] = {
    "task": "signal",  # generated chirps, MLP 128-256-10
    "steps": 300,
    "batch_size": 64,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "ranks": 2,
    "seed": 0,
    "eval_every": 100,
    "log_every": 50,
    "timeout": 200,
    "group_timeout": 60,
}
TOLERANCE = 0.01
"""DiLoCo's final accuracy may fall this far below the all-reduce's (docs/local-sgd.md)."""


@pytest.mark.timeout(240)
def test_diloco_every_50_steps_reaches_the_all_reduce_accuracy_with_20x_fewer_bytes(tmp_path: Path) -> None:
    """Measured here: 85.15% for DDP's all-reduce, 85.0% for DiLoCo every 50 steps (outer momentum 0.5),
    which sends 52x fewer bytes."""
    ddp = launch(TrainConfig(**CONVERGENCE, hook="torch:allreduce", out=str(tmp_path / "ddp")))["metrics"]
    diloco = launch(
        TrainConfig(**CONVERGENCE, sync="diloco:every=50,momentum=0.5", hook="allreduce", out=str(tmp_path / "dl"))
    )["metrics"]
    assert ddp["eval_accuracy"] > 0.8
    assert diloco["eval_accuracy"] >= ddp["eval_accuracy"] - TOLERANCE, (diloco["eval_accuracy"], ddp["eval_accuracy"])
    assert ddp["wire_bytes"] >= 20 * diloco["wire_bytes"] > 0, (ddp["wire_bytes"], diloco["wire_bytes"])


def test_the_local_sgd_sweep_puts_synchronizations_beside_the_hooks_on_both_study_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradcomp import netem

    monkeypatch.setattr(netem, "check", lambda profile, ranks=(): None)  # 100mbit needs root and tc
    runs = plan.load(plan.find_config("local-sgd"), str(tmp_path))
    methods: dict[str, set[str]] = {}
    for run in runs:
        methods.setdefault(run.label, set()).add(method(run.config.to_dict()))
    assert set(methods) == {"digits-mlp1024", "signal-mlp2048"}
    for label, names in methods.items():
        assert "torch:allreduce" in names and "torch:fp16" in names, label
        synchronized = [name for name in names if " over " in name]
        assert len(synchronized) == 6, (label, synchronized)
    assert {run.config.network for run in runs} == {"100mbit"} and {run.config.seed for run in runs} == {0, 1, 2}
    assert len(runs) == 57
