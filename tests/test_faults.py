"""The fault study (``gradcomp.experiments.faults``): replica groups on torchft, one lost and restarted.

One short real run (three groups on loopback, the digits, the third killed and restarted), and its
figures checked against the groups' own lines; the summary's arithmetic on lines made by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")
pytest.importorskip("sklearn")


def test_a_bad_study_is_refused_naming_what_is_wrong() -> None:
    from gradcomp.experiments.faults import FaultConfig

    with pytest.raises(ValueError, match=r"--kill must name a group 0\.\.2"):
        FaultConfig(out="x", kill=3)
    with pytest.raises(ValueError, match=r"--at must be a step inside the run \(1..99\)"):
        FaultConfig(out="x", steps=100, at=100)
    with pytest.raises(ValueError, match="--groups must be >= 2"):
        FaultConfig(out="x", groups=1, kill=0)
    with pytest.raises(ValueError, match="unknown compressor"):
        FaultConfig(out="x", hook="nonsense")
    FaultConfig(out="x", hook="auto:measure_at=3")  # auto under the hook; not as DiLoCo's outer gradients'
    with pytest.raises(ValueError, match="auto is no compressor"):
        FaultConfig(out="x", hook="auto", sync="diloco:every=10")


def _lines(folder: Path, group: int, entries: list[dict[str, Any]]) -> None:
    with open(folder / f"group{group}.jsonl", "w") as out:
        for entry in entries:
            out.write(json.dumps({"group": group, "time": 0.0, "pid": 1, **entry}) + "\n")


def _step(committed: int, participants: int, busy: float, ok: bool = True) -> dict[str, Any]:
    return {"kind": "step", "committed": committed, "ok": ok, "loss": 1.0, "participants": participants,
            "busy_ms": busy, "step_ms": 20.0}  # fmt: skip


def test_the_summary_splits_the_survivors_steps_by_the_loss_and_checks_their_record(tmp_path: Path) -> None:
    from gradcomp.experiments.faults import FaultConfig, summarize

    config = FaultConfig(out=str(tmp_path), groups=3, steps=6, at=2, restart_after=1)
    survivor = [_step(1, 3, 1.0), _step(2, 3, 3.0), _step(2, 2, 900.0, ok=False), _step(3, 2, 2.0),
                _step(4, 2, 4.0), _step(5, 3, 5.0), _step(6, 3, 7.0),
                {"kind": "eval", "committed": 6, "accuracy": 0.5, "loss": 1.0},
                {"kind": "end", "committed": 6, "attempted": 7, "sent_bytes": 2e6, "inner_steps": 7}]  # fmt: skip
    _lines(tmp_path, 0, survivor)
    _lines(tmp_path, 1, [e for e in survivor if e.get("committed") != 5])  # a committed step missing
    _lines(tmp_path, 2, [_step(1, 3, 1.0), _step(2, 3, 1.0), _step(5, 3, 1.0), _step(6, 3, 1.0)])
    summary = summarize(config, tmp_path, faulted=True)
    assert summary["step_ms"] == {"before": 2.0, "during": 4.0, "after": 7.0}  # both survivors' medians
    assert summary["longest_step_ms_during_loss"] == 900.0 and summary["steps_during_loss"] == 3
    assert summary["steps_lost"] == {0: 1, 1: 1} and summary["final_accuracy"][0] == 0.5
    assert summary["sent_mb"][0] == 2.0 and summary["committed"][2] is None  # the killed group wrote no end
    assert summary["survivors_recorded_every_step"] is False  # group 1's record lacks step 5
    _lines(tmp_path, 1, survivor)
    assert summarize(config, tmp_path, faulted=True)["survivors_recorded_every_step"] is True


def test_across_seeds_the_accuracy_differences_get_a_student_t_interval() -> None:
    from scipy import stats

    from gradcomp.experiments.faults import FaultConfig, across_seeds
    from gradcomp.experiments.report.faults import seeds_text

    config = FaultConfig(out="x")

    def study(free: float, faulted: float) -> dict[str, Any]:
        run = {"steps_during_loss": 100, "longest_step_ms_during_loss": 1000.0}
        return {"fault-free": {**run, "final_accuracy": {0: free}}, "faulted": {**run, "final_accuracy": {0: faulted}}}

    studies = {0: study(0.95, 0.96), 1: study(0.95, 0.945), 2: study(0.90, 0.91)}
    figures = across_seeds(studies, config)
    differences = [1.0, -0.5, 1.0]
    assert figures["difference_pp"] == pytest.approx(dict(enumerate(differences)))
    low, high = stats.t.interval(0.95, 2, loc=0.5, scale=stats.sem(differences))
    assert figures["mean_pp"] == pytest.approx(0.5) and figures["interval_pp"] == pytest.approx([low, high])
    assert figures["largest_pp"] == pytest.approx(1.0)
    assert f"mean +0.50 pp, 95% interval [{low:+.2f}, {high:+.2f}]" in seeds_text(studies, figures, config)
    assert across_seeds({0: study(0.9, 0.9)}, config)["interval_pp"] is None  # one seed: no interval


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_study_loses_a_group_restarts_it_and_the_survivors_go_on(tmp_path: Path) -> None:
    """Three groups under a lighthouse (uncompressed, no compile to wait for); the third killed at
    step 50 and restarted: the survivors commit every step to the end and record each, the third
    heals at their step and rejoins (its record: steps after its death, with three groups), and the
    study writes TensorBoard events per group and its page. A study: ``make test-slow`` (the
    kill, restart and healing it drives are tested in ``tests/test_torchft.py``, in the suite)."""
    import dataclasses

    from gradcomp.experiments.faults import FaultConfig, read_lines, run, table
    from gradcomp.experiments.report import faults as page

    # the restarted group rejoins about 50 steps (1 s) after its restart here: 260 leaves it 3x that
    config = FaultConfig(out=str(tmp_path), groups=3, hook="allreduce", steps=260, at=50, restart_after=20,
                         eval_every=65, twin=False)  # fmt: skip
    summary = run(config, tmp_path / "faulted", faulted=True)
    assert summary["committed"][0] == summary["committed"][1] == 260, summary
    assert summary["survivors_recorded_every_step"], summary
    assert max(summary["steps_lost"].values()) <= 2 and summary["steps_during_loss"] >= 20, summary
    assert summary["final_accuracy"][0] > 0.8, summary
    third = [e for e in read_lines(tmp_path / "faulted")[2] if e["kind"] == "step"]
    pids = list(dict.fromkeys(e["pid"] for e in third))
    assert len(pids) == 2, "one life before the kill, one after"
    second_life = [e for e in third if e["pid"] == pids[1] and e["ok"]]
    assert second_life and second_life[0]["committed"] > 50 + 20, "it healed at the survivors' step, not from 0"
    assert second_life[-1]["committed"] == 260 and second_life[-1]["participants"] == 3
    assert all(any((tmp_path / "faulted" / f"group{g}").glob("events.out.tfevents.*")) for g in range(3))
    results = {"config": dataclasses.asdict(config), "faulted": summary}
    written = page.write(tmp_path, results, table(results, config)).read_text()
    assert written.count("<svg") == 1 and "group 2 killed" in written and "<td>faulted</td>" in written


def test_several_methods_each_get_a_folder_and_one_page_compares_them(tmp_path: Path, monkeypatch: Any) -> None:
    """``--hook`` repeated: a study per method under ``--out/<method>``, then their accuracy
    differences side by side in ``summary.json`` and ``report.html`` (each method's page linked)."""
    from gradcomp.experiments import faults

    ran: dict[str, str] = {}

    def one_method(config: Any, seeds: Any, page: Any) -> dict[str, Any]:
        ran[config.hook] = config.out
        differences = {seed: 0.25 * (seed + 1) for seed in seeds}
        return {"difference_pp": differences, "mean_pp": 0.375, "interval_pp": [-2.8, 3.55], "largest_pp": 0.5}

    monkeypatch.setattr(faults, "one_method", one_method)
    hooks = ["topk:ratio=0.01,ef=true", "auto:candidates=fp16|quantize:bits=4"]
    argv = [arg for hook in hooks for arg in ("--hook", hook)] + ["--seeds", "0,1", "--out", str(tmp_path)]
    assert faults.main(argv) == 0
    assert ran == {hooks[0]: str(tmp_path / "topk-ratio=0.01-ef=true"),
                   hooks[1]: str(tmp_path / "auto-candidates=fp16-quantize-bits=4")}  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["methods"]) == hooks and summary["methods"][hooks[0]]["mean_pp"] == 0.375
    page = (tmp_path / "report.html").read_text()
    # auto's '|' stays inside its cell: every row has the header's five cells
    assert page.count("<td>") == 2 * 5 and "<td>auto:candidates=fp16|quantize:bits=4</td>" in page
    assert 'href="topk-ratio=0.01-ef=true/report.html"' in page and "+0.38" in page and "[-2.80, +3.55]" in page
    with pytest.raises(SystemExit):  # no twin to compare with
        faults.main([*argv, "--no-twin"])
    from gradcomp.experiments.report.faults import methods_text

    # +0.25 and -0.25 points read back from accuracies need not cancel exactly: no "-0.00"
    tiny = {"difference_pp": {0: 0.25, 1: -0.25}, "mean_pp": -1e-17, "interval_pp": None, "largest_pp": 0.25}
    assert "| m | 2 | +0.00 | - | 0.25 |" in methods_text({"m": tiny})


def test_what_auto_ended_with_names_the_groups_that_finished() -> None:
    from gradcomp.experiments.faults import auto_text

    results = {"fault-free": {"auto_chose": {0: ["fp16"], 1: ["fp16"], 2: ["fp16"]}},
               "faulted": {"auto_chose": {0: ["fp16", "topk:ratio=0.01"], 1: ["fp16"]}}}  # fmt: skip
    assert auto_text(results).splitlines() == [
        "fault-free: auto ended with fp16 (groups 0, 1, 2)",
        "faulted: auto ended with {0: ['fp16', 'topk:ratio=0.01'], 1: ['fp16']} (groups 0, 1)",
    ]
    assert auto_text({"faulted": {"auto_chose": {}}}) == ""  # not auto
