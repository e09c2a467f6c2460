"""``gradcomp sweep``: configs checked before anything runs, interrupted sweeps resumed, failures recorded.

The resume scenario is a sweep of three runs on a small dataset of our own, two ranks each: one
finished before (it must be left alone), one that failed before (it runs again), and one whose data
file is corrupt (it fails, is recorded, and the sweep goes on to the next run).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradcomp import netem
from gradcomp.engine.spec import HookSpec
from gradcomp.experiments.sweep import plan
from gradcomp.experiments.sweep import runner as sweep
from gradcomp.experiments.sweep.plan import Run
from gradcomp.experiments.tasks import build_task
from gradcomp.experiments.training import runinfo

CONFIG = """
[sweep]
task = "classify"
steps = 20
batch_size = 32
lr = 0.1
eval_every = 10
timeout = 120
group_timeout = 60

[grid]
hooks = ["allreduce", "quantize:bits=4"]
ranks = [2]

[[tasks]]
name = "corrupt"
data = "corrupt.npz"
hooks = ["allreduce"]

[[tasks]]
name = "good"
data = "good.npz"

[[tasks]]
name = "wide"                     # 2.1 MB of gradients: DDP makes two buckets, which torch's PowerSGD hangs on
task = "classify:hidden=1024-512"
data = "good.npz"
hooks = ["torch:powersgd:rank=2"]
"""


def _write_data(directory: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 12)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
    np.savez(directory / "good.npz", x=x, y=y)
    np.savez(directory / "corrupt.npz", x=x.astype(np.int32), y=y)  # integer samples: refused when loaded


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sweep")
    _write_data(root)
    (root / "sweep.toml").write_text(CONFIG)
    out = root / "out"
    # by the hook's name (runs record the canonical text of the spec: HookSpec)
    runs = {
        run.label + "/" + run.config.effective.hook.split(":")[0]: run
        for run in plan.load(str(root / "sweep.toml"), str(out))
    }
    finished, failed = runs["good/quantize"], runs["good/allreduce"]
    # as an interrupted sweep leaves them: one run finished, one failed (with events of its attempt)
    record = {"name": finished.name, "config": finished.config.to_dict(), "metrics": {"marker": 1}}
    runinfo.write(finished.config.out, {**record, "status": "finished"})
    runinfo.write(failed.config.out, {"name": failed.name, "config": failed.config.to_dict(), "status": "failed"})
    Path(failed.config.out, "events.out.tfevents.0.stale").write_bytes(b"")
    Path(finished.config.checkpoint_path).write_bytes(b"x" * 4000)  # left by an older sweep
    before = Path(finished.config.out, "run.json").read_text()
    launched: list[str] = []
    real_launch = sweep.launch

    def recording_launch(config: Any, **options: Any) -> dict[str, Any]:
        launched.append(os.path.basename(config.out))
        return real_launch(config, **options)

    progress = io.StringIO()
    sweep.launch = recording_launch  # type: ignore[assignment]
    try:
        rows = sweep.run_sweep(list(runs.values()), sweep.Progress(progress))
    finally:
        sweep.launch = real_launch  # type: ignore[assignment]
    return {"runs": runs, "rows": rows, "launched": launched, "progress": progress.getvalue(), "before": before}


@pytest.mark.timeout(180)
def test_an_interrupted_sweep_runs_only_what_is_missing(resumed: dict[str, Any]) -> None:
    runs = resumed["runs"]
    # the corrupt run is refused before any rank starts (its data cannot serve a batch), and recorded
    assert resumed["launched"] == [runs["good/allreduce"].name, runs["wide/torch"].name]
    finished = runs["good/quantize"].config.out
    assert Path(finished, "run.json").read_text() == resumed["before"]  # left alone
    assert sorted(os.listdir(finished)) == ["run.json"]  # but for its checkpoint: never resumed


@pytest.mark.timeout(180)
def test_only_unfinished_runs_keep_their_checkpoints(resumed: dict[str, Any]) -> None:
    """A finished run's checkpoint is removed as it finishes; what the summary and the report read stays."""
    runs = resumed["runs"]
    done = Path(runs["good/allreduce"].config.out)
    assert not (done / "checkpoint.pt").exists()
    assert {"run.json", "curves.jsonl"} <= set(os.listdir(done)) and any(done.glob("events.out.tfevents.*"))
    rows = {row.name: row for row in resumed["rows"]}
    assert rows[runs["good/allreduce"].name].value is not None  # the summary reads run.json
    assert "sweep: removed the checkpoints of 2 finished runs (" in resumed["progress"]


def test_finished_runs_checkpoints_are_kept_when_asked(tmp_path: Path) -> None:
    """``--keep-checkpoints``: a sweep removes nothing; without it, the leftovers of finished runs go."""
    (tmp_path / "sweep.toml").write_text(GOOD)
    runs = plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))
    for run in runs:
        runinfo.write(run.config.out, {"name": run.name, "config": run.config.to_dict(), "status": "finished"})
        Path(run.config.checkpoint_path).write_bytes(b"x" * 1000)
    stream = io.StringIO()
    sweep.run_sweep(runs, sweep.Progress(stream), keep_checkpoints=True)
    assert all(Path(run.config.checkpoint_path).exists() for run in runs) and "removed" not in stream.getvalue()
    sweep.run_sweep(runs, sweep.Progress(stream))
    assert not any(Path(run.config.checkpoint_path).exists() for run in runs)
    assert "removed the checkpoints of 2 finished runs (0.0 MB; --keep-checkpoints keeps them)" in stream.getvalue()
    from gradcomp.experiments.sweep.command import command_parser

    assert command_parser().parse_args(["quick", "--keep-checkpoints"]).keep_checkpoints


@pytest.mark.timeout(180)
def test_a_failed_run_is_recorded_and_the_sweep_goes_on(resumed: dict[str, Any]) -> None:
    runs = resumed["runs"]
    record = runinfo.read(runs["corrupt/allreduce"].config.out)
    assert record is not None and record["status"] == "failed"
    assert "x must be floating point" in record["error"]
    assert record["config"] == runs["corrupt/allreduce"].config.to_dict()
    rerun = runinfo.read(runs["good/allreduce"].config.out)  # launched after the failure
    assert rerun is not None and rerun["status"] == "finished"
    assert not Path(runs["good/allreduce"].config.out, "events.out.tfevents.0.stale").exists()
    refused = runinfo.read(runs["wide/torch"].config.out)  # torch's PowerSGD with two buckets on gloo: not a hang
    assert refused is not None and refused["status"] == "failed"
    assert "ValueError: torch's PowerSGD hook hangs on gloo when DDP splits the gradients" in refused["error"]


@pytest.mark.timeout(180)
def test_native_all_reduce_bytes_count_a_ring(resumed: dict[str, Any]) -> None:
    record = runinfo.read(resumed["runs"]["good/allreduce"].config.out)
    assert record is not None
    parameters = record["task"]["parameters"]  # MLP 12-256-4 on the 4 classes of the file
    assert parameters == 12 * 256 + 256 + 256 * 4 + 4
    metrics = record["metrics"]
    # 20 steps; each all-reduces every fp32 gradient; a ring sends 2 (p - 1) / p of it per rank
    assert metrics["wire_bytes"] == 20 * 4 * parameters * 2 * (2 - 1) // 2
    assert metrics["wire_bytes_estimated"] is True and metrics["compression_ratio"] == 1


@pytest.mark.timeout(180)
def test_the_summary_and_the_progress_bar(resumed: dict[str, Any]) -> None:
    rows = {row.name: row for row in resumed["rows"]}
    runs = resumed["runs"]
    assert [rows[run.name].status for run in runs.values()] == ["failed", "finished", "finished", "failed"]
    good = rows[runs["good/allreduce"].name]
    assert good.metric == "eval_accuracy" and good.value is not None and 0 <= good.value <= 1
    assert good.wire_mb is not None and good.wire_mb > 0 and good.train_s is not None
    table = sweep.format_summary(resumed["rows"])
    lines = table.splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")] == [
        "run", "status", "metric", "final", "wire MB", "train s"
    ]  # fmt: skip
    assert len(lines) == 2 + len(runs) and all(run.name in table for run in runs.values())
    progress = resumed["progress"]
    assert "4 runs, 1 finished before, 3 to run" in progress
    assert "1/3" in progress and "3/3" in progress and "ETA" in progress


# -- configs checked before anything runs ---------------------------------------------------------

GOOD = """
[sweep]
task = "digits"
steps = 10
batch_size = 32

[grid]
hooks = ["allreduce", "fp16"]
"""


def _refused(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as error:
        plan.load(str(path), str(out))
    assert not out.exists()
    return str(error.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("[grid]", "[grids]"), "unknown section(s) ['grids']; valid: sweep, grid, tasks"),
        (("steps = 10", "steps = 10\nlearning_rate = 0.1"), "unknown setting(s) ['learning_rate']"),
        (("steps = 10", "steps = 10\nhook = 'fp16'"), "(hook: use the axis hooks = [...])"),
        (("steps = 10", "steps = 10\nlr = [0.1, 0.2]"), "lr given as a list; axes go in [grid]"),
        (('hooks = ["allreduce", "fp16"]', 'hooks = ["allreduce"]\nbatch = [1]'), "unknown axis(s) ['batch']"),
        (('"fp16"', '"topk:ratio=2"'), "hook 'topk:ratio=2': invalid options for 'topk': ratio must be in (0, 1]"),
        (('"fp16"', '"zip"'), "unknown compressor 'zip'"),
        (('"fp16"', '"topk:rate=0.1"'), "unknown option(s) ['rate'] for 'topk'"),
        (('"fp16"', '"allreduce"'), "two runs would be named"),
        (("steps = 10", "steps = 'ten'"), "option 'steps' must be an integer; got 'ten'"),
        (("batch_size = 32", "batch_size = -1"), "batch_size must be > 0"),
        (('hooks = ["allreduce", "fp16"]', 'hooks = ["fp16"]\nranks = [3]'), "does not split evenly over 3 ranks"),
        (('hooks = ["allreduce", "fp16"]', 'hooks = ["fp16"]\nranks = []'), "ranks must be a non-empty list"),
        (('hooks = ["allreduce", "fp16"]', 'hooks = ["fp16"]\nnetworks = ["2ghz"]'), "network '2ghz': bad rate"),
        (('task = "digits"', 'task = "digits:width=3"'), "unknown option(s) ['width'] for task 'digits'"),
        (('task = "digits"', 'task = "classify"\ndata = "missing.npz"'), "does not exist"),
        (("[grid]", "[grid"), "not valid TOML"),
    ],
)
def test_an_invalid_config_is_refused_before_anything_runs(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    assert change[0] in GOOD
    assert message in _refused(tmp_path, GOOD.replace(change[0], change[1], 1))


def test_no_hooks_is_refused(tmp_path: Path) -> None:
    assert "no hooks to compare" in _refused(tmp_path, GOOD.replace('hooks = ["allreduce", "fp16"]', ""))


def test_runs_made_with_other_settings_are_refused(tmp_path: Path) -> None:
    (tmp_path / "sweep.toml").write_text(GOOD)
    runs = plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))
    old = dataclasses.replace(runs[0].config, lr=0.5)
    runinfo.write(runs[0].config.out, {"name": runs[0].name, "config": old.to_dict(), "status": "finished"})
    with pytest.raises(ValueError, match=r"other settings .*lr: 0.5 -> 0.1"):
        sweep.run_sweep(runs)
    assert sorted(os.listdir(tmp_path / "out")) == [runs[0].name]  # nothing else started


def test_the_command_line_refuses_a_bad_config_with_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradcomp.cli import main

    path = tmp_path / "bad.toml"
    path.write_text(GOOD.replace('"fp16"', '"quantize:bits=9"'))
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "bits must be in 1..8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_command_line_lists_the_runs_of_a_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradcomp.cli import main

    (tmp_path / "sweep.toml").write_text(GOOD)
    assert main(["sweep", str(tmp_path / "sweep.toml"), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "digits-mlp_allreduce_p2_loopback_seed0  not started",
        "digits-mlp_fp16_p2_loopback_seed0  not started",
        f"2 runs in {tmp_path / 'out'}",
    ]


# -- the shipped configs ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _shipped(name: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> list[Run]:
    """The runs of a shipped config, its emulated networks taken as buildable (that needs root)."""
    monkeypatch.setattr(netem, "check", lambda profile, ranks=(): None)
    return plan.load(str(ROOT / f"experiments/configs/{name}.toml"), str(out))


def test_the_quick_sweep_compares_six_methods_with_torch_hooks_on_two_networks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _shipped("quick", tmp_path, monkeypatch)
    hooks = list(dict.fromkeys(run.config.effective.hook for run in runs))
    given = ["fp16", "topk:ratio=0.01,ef=true", "powersgd:rank=4,ef=true", "quantize:bits=4"]
    assert hooks == ["torch:allreduce", "torch:fp16", *(str(HookSpec.parse(hook)) for hook in given)]
    assert {(run.config.task, run.config.ranks) for run in runs} == {("digits:hidden=1024-1024", 2)}
    assert {run.config.network for run in runs} == {"loopback", "1gbit"}
    assert len(runs) == 6 * 2 * len({run.config.seed for run in runs}) == 36


def test_the_study_compares_the_methods_of_the_issue_against_torch_on_three_networks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _shipped("study", tmp_path, monkeypatch)
    hooks = set(dict.fromkeys(run.config.effective.hook for run in runs))
    torch_hooks = {"torch:allreduce", "torch:fp16", "torch:powersgd:rank=4"}
    given = ["fp16", "powersgd:rank=1,ef=true", "powersgd:rank=4,ef=true", "topk:ratio=0.01,ef=true", "sign:ef=true",
             "quantize:bits=4", "randomk:ratio=0.01,scale=false,ef=true"]  # fmt: skip
    assert hooks == torch_hooks | {str(HookSpec.parse(hook)) for hook in given}
    assert {run.label for run in runs} == {"digits-mlp1024", "signal-mlp2048", "charlm-gpt12"}
    assert {run.config.network for run in runs} == {"loopback", "1gbit", "100mbit"}
    assert {run.config.seed for run in runs} == {0, 1, 2} and {run.config.ranks for run in runs} == {2}
    assert len(runs) == 3 * 10 * 3 * 3
    (many,) = {run.config.task for run in runs if run.label == "charlm-gpt12"}
    model = build_task(many).build_model("chartransformer")
    assert len(list(model.parameters())) >= 140  # the many-tensor task: GPT-2 small has 148


def test_the_nodes_sweep_compares_hierarchical_hooks_with_flat_ones_on_a_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _shipped("nodes", tmp_path, monkeypatch)
    hooks = {run.config.effective.hook for run in runs}
    assert {h for h in hooks if "local_size=2" in h} == {
        str(HookSpec.parse("topk:ratio=0.01,ef=true,local_size=2")),
        str(HookSpec.parse("quantize:bits=4,local_size=2")),
    }
    assert {run.config.network for run in runs} == {"nodes=2x2,intra=10gbit,inter=100mbit"}
    assert {run.config.ranks for run in runs} == {4} and len(runs) == 5 * 3


def test_the_hsdp_sweep_compares_gradcomp_across_nodes_with_fsdp2s_own_hsdp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _shipped("hsdp", tmp_path, monkeypatch)
    hooks = {run.config.effective.hook for run in runs}
    given = ["quantize:bits=4,ef=true", "topk:ratio=0.01,ef=true"]
    assert hooks == {"torch:reduce_scatter", "torch:bf16", *(str(HookSpec.parse(hook)) for hook in given)}
    assert {(run.config.parallel, run.config.network, run.config.local_size) for run in runs} == {
        ("hsdp", "nodes=2x2,intra=10gbit,inter=100mbit", 2)
    }
    assert {run.config.ranks for run in runs} == {4} and len(runs) == 4 * 3


def test_the_fidelity_sweep_trains_every_method_with_momentum_on_both_study_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Momentum 0.9 everywhere: in the optimizer, or moved into the hooks that ask for it."""
    runs = _shipped("fidelity", tmp_path, monkeypatch)
    assert {run.label for run in runs} == {"digits-mlp1024", "signal-mlp2048"} and len(runs) == 2 * 11 * 3
    for run in runs:
        effective = run.config.effective
        moved = "momentum=0.9" in effective.hook
        assert run.config.momentum == 0.9 and effective.momentum == (0.0 if moved else 0.9), run.name
        assert run.config.schedule == "cosine" and run.config.network == "loopback"
    warmups = {(run.label, spec.warmup) for run in runs if isinstance(spec := run.config.hook_spec, HookSpec)}
    assert warmups == {("digits-mlp1024", 0), ("digits-mlp1024", 50), ("signal-mlp2048", 0), ("signal-mlp2048", 75)}


def test_networks_this_machine_cannot_build_are_left_out_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def check(profile: str, ranks: object = ()) -> None:
        if profile != "loopback":
            raise ValueError(f"network {profile!r}: emulated networks need root")

    monkeypatch.setattr(netem, "check", check)
    config = str(ROOT / "experiments/configs/quick.toml")
    with pytest.raises(ValueError, match="emulated networks need root"):
        plan.load(config, str(tmp_path))
    skipped: dict[str, str] = {}
    runs = plan.load(config, str(tmp_path), skipped)
    assert {run.config.network for run in runs} == {"loopback"} and len(runs) == 18
    assert skipped == {"1gbit": "network '1gbit': emulated networks need root"}


def test_the_full_study_covers_tasks_methods_seeds_and_networks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _shipped("full", tmp_path, monkeypatch)
    assert {run.label for run in runs} == {"digits-mlp", "digits-cnn", "signal-cnn", "charlm"}
    assert len({run.config.effective.hook for run in runs}) >= 6
    assert len({run.config.seed for run in runs}) >= 3 and len({run.config.network for run in runs}) >= 2
    assert len(runs) == len({run.name for run in runs})
    by_label = {run.label: run.config for run in runs}
    assert by_label["charlm"].optimizer == "adamw" and by_label["signal-cnn"].model == "signalcnn"
    json.dumps([run.config.to_dict() for run in runs])  # every setting is plain data
