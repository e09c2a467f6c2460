"""``gradcomp report``: its figures from a fixture of run records against values computed here, failed,
unfinished and missing runs, a single run, and the page itself (self-contained, rendered by Chromium)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from scipy import stats

from gradcomp.cli import main
from gradcomp.experiments.report import analysis, page, records
from gradcomp.experiments.report.analysis import Metric
from gradcomp.experiments.training import runinfo

TIMES = [0.0, 1.0, 2.0, 3.0, 4.0]
"""Training seconds of the five evaluations of every fixture run (steps 0, 10, 20, 30, 40), scaled per method."""
# Per method and seed: the accuracy at each evaluation. The baseline (torch:allreduce) ends at 0.95,
# 0.96 and 0.97: mean 0.96, so the target at 0.5 pp is 0.955.
ACCURACY = {
    "torch:allreduce": [[0.1, 0.5, 0.8, 0.93, 0.95], [0.1, 0.6, 0.9, 0.956, 0.96], [0.1, 0.6, 0.96, 0.97, 0.97]],
    "torch:fp16": [[0.1, 0.5, 0.8, 0.955, 0.96], [0.1, 0.6, 0.9, 0.958, 0.96], [0.1, 0.7, 0.95, 0.96, 0.96]],
    "topk:ratio=0.01,ef=true": [
        [0.1, 0.5, 0.96, 0.96, 0.96], [0.1, 0.7, 0.956, 0.96, 0.96], [0.1, 0.8, 0.9, 0.955, 0.958]
    ],
    "quantize:bits=4": [[0.1, 0.5, 0.8, 0.9, 0.94], [0.1, 0.6, 0.9, 0.955, 0.96], [0.1, 0.5, 0.8, 0.95, 0.956]],
}  # fmt: skip
SPEED = {
    "1gbit": {"torch:allreduce": 1.0, "torch:fp16": 0.8, "topk:ratio=0.01,ef=true": 0.5, "quantize:bits=4": 0.6},
    "loopback": {"torch:allreduce": 1.0, "torch:fp16": 1.4, "topk:ratio=0.01,ef=true": 1.6, "quantize:bits=4": 1.5},
}
"""Each method's training time as a fraction of the baseline's, per network."""
WIRE = {"torch:allreduce": 4e6, "torch:fp16": 2e6, "topk:ratio=0.01,ef=true": 8e4, "quantize:bits=4": 5e5}
"""Bytes sent per rank per step."""
STEPS = 40
LABEL = "digits-mlp"


def _write_run(
    root: Path, hook: str, network: str, seed: int, *, status: str = "finished", error: str = "", parallel: str = "ddp"
) -> str:
    name = f"{LABEL}_{re.sub(r'[^A-Za-z0-9._=+]+', '-', hook)}_p2_{network}_seed{seed}"
    name += "" if parallel == "ddp" else f"_{parallel}"
    out = root / name
    speed = SPEED[network].get(hook, 1.0)
    accuracy = ACCURACY.get(hook, ACCURACY["torch:allreduce"])[seed]
    record: dict[str, Any] = {
        "name": name,
        "config": {"task": "digits", "hook": hook, "network": network, "ranks": 2, "seed": seed, "parallel": parallel},
        "world_size": 2,
        "task": {"name": "digits", "model": "mlp", "headline": "eval_accuracy"},
        "environment": {"cpu": "Fixture CPU", "cpus": 2, "torch": "2.13.0", "backend": "gloo"},
        "status": status,
    }
    if status == "failed":
        record["error"] = error
        runinfo.write(str(out), record)
        return name
    points = []
    for i, (time, value) in enumerate(zip(TIMES, accuracy, strict=True)):
        step = 10 * i
        where = {"step": step, "time_s": time * speed, "wire_bytes": step * WIRE.get(hook, 0)}
        points.append({"kind": "eval", **where, "accuracy": value, "loss": 1 - value})
        if step:
            points.append({"kind": "train", **where, "loss": 1.1 - value})
    if status == "finished":
        compress = None if hook.startswith("torch:") else 1.0
        record["metrics"] = {
            "step": STEPS, "eval_accuracy": accuracy[-1], "eval_loss": 1 - accuracy[-1],
            "train_time_s": TIMES[-1] * speed,
            "wire_bytes": STEPS * WIRE.get(hook, 0), "compression_ratio": 4e6 / WIRE.get(hook, 4e6),
            "compute_ms": 30.0, "compress_ms": compress, "decompress_ms": compress and 0.5,
        }  # fmt: skip
    runinfo.write(str(out), record)
    with open(out / "curves.jsonl", "w") as file:
        file.writelines(json.dumps(p) + "\n" for p in points)
    return name


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep's directory: four methods x 3 seeds on 1gbit and loopback; torch's PowerSGD failed on
    1gbit; one quantize run still running and one never started (in the sweep's plan only)."""
    root = tmp_path_factory.mktemp("sweep")
    planned = []
    for network in ("1gbit", "loopback"):
        for seed in range(3):
            for hook in ACCURACY:
                if network == "loopback" and hook == "quantize:bits=4" and seed == 2:
                    name = f"{LABEL}_quantize-bits=4_p2_loopback_seed2"  # planned, never started
                elif network == "loopback" and hook == "quantize:bits=4" and seed == 1:
                    name = _write_run(root, hook, network, seed, status="running")
                else:
                    name = _write_run(root, hook, network, seed)
                planned.append({"name": name, "label": LABEL, "hook": hook, "network": network, "ranks": 2,
                                "seed": seed})  # fmt: skip
        error = (
            "rank 0 of 2 failed:\nTraceback (most recent call last):\n  File x\nValueError: torch's PowerSGD hook hangs"
        )
        name = _write_run(root, "torch:powersgd:rank=4", network, 0, status="failed", error=error)
        planned.append({"name": name, "label": LABEL, "hook": "torch:powersgd:rank=4", "network": network,
                        "ranks": 2, "seed": 0})  # fmt: skip
    records.write_plan(str(root), "fixture.toml", planned)
    return root


def _expected_time_to_target(hook: str, network: str, target: float) -> list[float | None]:
    """Each seed's time at its first evaluation that meets ``target``."""
    speed = SPEED[network][hook]
    times = []
    for accuracy in ACCURACY[hook]:
        first = next((i for i, value in enumerate(accuracy) if value >= target), None)
        times.append(None if first is None else TIMES[first] * speed)
    return times


def test_figures_equal_an_independent_computation(sweep: Path) -> None:
    groups = analysis.analyze(records.load(str(sweep)), tolerance=0.5)
    assert [g.title for g in groups] == ["digits-mlp, 1gbit, 2 ranks", "digits-mlp, loopback, 2 ranks"]
    group = groups[0]
    assert group.baseline == "torch:allreduce" and group.target == pytest.approx(0.96 - 0.005)
    target = 0.955
    expected = {h: _expected_time_to_target(h, "1gbit", target) for h in ACCURACY}
    # by hand: torch:allreduce's seeds meet 0.955 at evaluations -, 3, 2 (times 0..4 s); topk's at 2, 2, 3 (x 0.5)
    assert expected["torch:allreduce"] == [None, 3.0, 2.0] and expected["topk:ratio=0.01,ef=true"] == [1.0, 1.0, 1.5]
    assert expected["quantize:bits=4"] == pytest.approx([None, 1.8, 2.4])
    # the means over seeds at each evaluation: allreduce .1 .567 .887 .952 .960 meets 0.955 at 4 s; fp16
    # (.955 + .958 + .96) / 3 at evaluation 3 (x 0.8: 2.4 s); topk (.96 + .96 + .955) / 3 at 3 (x 0.5: 1.5 s);
    # quantize .935 then .952: never
    mean_time = {"torch:allreduce": 4.0, "torch:fp16": 2.4, "topk:ratio=0.01,ef=true": 1.5, "quantize:bits=4": None}
    for method in group.methods:
        if method.hook not in ACCURACY:
            continue
        finals = [a[-1] for a in ACCURACY[method.hook]]
        assert method.final_mean == pytest.approx(sum(finals) / 3)
        assert method.final_std == pytest.approx(math.sqrt(sum((f - sum(finals) / 3) ** 2 for f in finals) / 2))
        assert method.times_to_target == pytest.approx(expected[method.hook])
        assert method.time_to_target == pytest.approx(mean_time[method.hook])
        if method.final_ci is not None:
            half = stats.t.ppf(0.975, 2) * statistics.stdev(finals) / math.sqrt(3)
            assert method.final_ci == pytest.approx((statistics.fmean(finals) - half, statistics.fmean(finals) + half))
        assert method.wire_mb_per_step == pytest.approx(WIRE[method.hook] / 1e6)
        assert method.fewer_bytes == pytest.approx(WIRE["torch:allreduce"] / WIRE[method.hook])
        assert method.step_ms == pytest.approx(1e3 * 4.0 * SPEED["1gbit"][method.hook] / STEPS)
    by_hook = {m.hook: m for m in group.methods}
    topk = by_hook["topk:ratio=0.01,ef=true"]
    assert topk.speedup_vs_baseline == pytest.approx(4.0 / 1.5)
    assert group.fastest_torch == "torch:fp16"
    assert topk.speedup_vs_torch == pytest.approx(2.4 / 1.5)
    seeds = ([1.0, 1.0, 1.5], [2.4, 2.4, 2.4])
    assert topk.time_p == pytest.approx(_welch_p(*seeds))
    assert topk.compress_ms == pytest.approx(1.5) and by_hook["torch:fp16"].compress_ms is None
    assert topk.exposed_ms == pytest.approx(1e3 * 2.0 / STEPS - 30.0 - 1.5)
    assert by_hook["quantize:bits=4"].time_to_target is None and by_hook["quantize:bits=4"].reached == 2
    a, b = [a[-1] for a in ACCURACY["torch:fp16"]], [a[-1] for a in ACCURACY["torch:allreduce"]]
    assert by_hook["torch:fp16"].final_p == pytest.approx(_welch_p(a, b))
    failed = by_hook["torch:powersgd:rank=4"]
    assert [r.reason for r in failed.failed] == ["ValueError: torch's PowerSGD hook hangs"]
    # the baseline's seeds reach the target at 3.0 and 2.0 s (one never does), topk's at 1.0, 1.0, 1.5: the
    # 2.67x of the means is within the noise of two and three seeds, and the verdict leads with that
    assert topk.baseline_p == pytest.approx(_welch_p([1.0, 1.0, 1.5], [3.0, 2.0])) and topk.baseline_p > 0.05
    assert group.verdict == (
        "Within the noise of torch:allreduce: nothing reaches the target (95.50%) measurably sooner here. "
        f"topk:ratio=0.01,ef=true is first, in 1.50 s against 4.00 s (2.67x, Welch p = {topk.baseline_p:.2f} over "
        "the seeds: within the noise)."
    )


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _welch_p(a: list[float], b: list[float]) -> float:
    """Welch's two-sided t-test, from its formula."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(2 * stats.t.sf(abs(t), df))


def test_where_nothing_beats_the_baseline_the_verdict_says_so_and_partial_runs_are_listed(sweep: Path) -> None:
    groups = analysis.analyze(records.load(str(sweep)))
    loopback = groups[1]
    # on loopback the compressors are slower per step: the baseline's mean meets 0.955 at 4.0 s, fp16's
    # at 3 x 1.4 = 4.2 s, topk's at 3 x 1.6 = 4.8 s
    assert loopback.verdict == (
        "Nothing beats torch:allreduce here: it reaches the target (95.50%) first, in 4.00 s; the fastest "
        "gradcomp method, topk:ratio=0.01,ef=true, takes 4.80 s."
    )
    quantize = loopback.method("quantize:bits=4")
    assert quantize is not None
    assert [r.status for r in quantize.runs] == ["finished", "running", "missing"]
    assert [r.status for r in quantize.unfinished] == ["running", "missing"]
    assert quantize.times_to_target == [None]  # the finished seed never reached the target
    only_baseline = analysis.analyze([r for r in records.load(str(sweep)) if r.hook.startswith("torch:allreduce")])
    assert (
        only_baseline[0].verdict
        == "Nothing beats torch:allreduce here: it reaches the target (95.50%) first, in 4.00 s."
    )
    no_baseline = analysis.analyze([r for r in records.load(str(sweep)) if r.hook == "quantize:bits=4"])
    assert "no target" in no_baseline[0].verdict


def test_a_baseline_can_be_named_and_the_tolerance_moves_the_target(sweep: Path) -> None:
    runs = records.load(str(sweep))
    group = analysis.analyze(runs, tolerance=2.0, baseline="torch:fp16")[0]
    assert group.baseline == "torch:fp16" and group.target == pytest.approx(0.96 - 0.02)
    with pytest.raises(ValueError, match="tolerance must be"):
        analysis.analyze(runs, tolerance=-1)
    assert Metric("eval_perplexity").target(50.0, 10) == pytest.approx(55.0)  # lower is better: 10% above
    assert Metric("eval_loss").meets(0.4, 0.5) and not Metric("eval_accuracy").meets(0.4, 0.5)


def test_a_falling_metric_can_be_chosen_its_target_above_the_baseline(sweep: Path) -> None:
    """``metric="loss"``: the target is the baseline's final loss plus 1% of it, and a seed reaches it
    at its first evaluation whose loss is at or below it."""
    runs = [r for r in records.load(str(sweep)) if r.network == "1gbit"]
    group = analysis.analyze(runs, tolerance=1.0, metric="loss")[0]
    assert group.metric is not None and group.metric.name == "loss" and not group.metric.higher_is_better
    baseline = statistics.fmean(1 - accuracy[-1] for accuracy in ACCURACY["torch:allreduce"])
    assert group.target == pytest.approx(baseline * 1.01)
    for method in group.methods:
        if method.hook not in ACCURACY:
            continue
        expected = []
        for accuracy in ACCURACY[method.hook]:
            first = next((i for i, value in enumerate(accuracy) if 1 - value <= baseline * 1.01), None)
            expected.append(None if first is None else TIMES[first] * SPEED["1gbit"][method.hook])
        assert method.times_to_target == pytest.approx(expected), method.hook
    with pytest.raises(ValueError, match="no evaluation metric 'bleu' in digits-mlp; valid: accuracy, loss"):
        analysis.analyze(runs, metric="bleu")


def test_curves_are_the_mean_and_range_over_seeds_at_common_steps(sweep: Path) -> None:
    runs = [r for r in records.load(str(sweep)) if r.hook == "torch:allreduce" and r.network == "1gbit"]
    line = analysis.curve(runs, "eval", "accuracy", "time_s")
    assert line is not None and line.x == pytest.approx(TIMES)
    values = list(zip(*ACCURACY["torch:allreduce"], strict=True))
    assert line.mean == pytest.approx([statistics.fmean(v) for v in values])
    assert line.low == pytest.approx([min(v) for v in values]) and line.high == pytest.approx([max(v) for v in values])
    wire = analysis.curve(runs, "train", "loss", "wire_bytes")
    assert wire is not None and wire.x == pytest.approx([10 * i * 4e6 for i in range(1, 5)])


def _page(sweep: Path, tmp_path: Path) -> str:
    output = tmp_path / "report.html"
    assert main(["report", str(sweep), "-o", str(output)]) == 0
    return output.read_text()


def test_the_page_is_self_contained_and_shows_every_group_table_and_failure(sweep: Path, tmp_path: Path) -> None:
    text = _page(sweep, tmp_path)
    # nothing to fetch: no scheme, no protocol-relative or file reference; url() and href only to #ids in the page
    assert "<script" not in text and not re.search(r"[a-z]+://|\s//|@import|url\((?!#)|href=\"(?!#)|src=", text, re.I)
    assert text.count("<svg") == 4  # per group: time to target and the curves
    assert text.count('<h2 id="group-') == 2 and text.count("<table>") == 3  # a group's each, and across them
    assert text.count('<h2 id="across">Across the groups</h2>') == 1
    assert "ValueError: torch&#x27;s PowerSGD hook hangs" in text
    assert "digits-mlp_quantize-bits=4_p2_loopback_seed2" in text  # the missing run is listed
    assert "(running)" in text and "not reached" in text and "Fixture CPU" in text
    assert "topk:ratio=0.01,ef=true is first, in 1.50 s against 4.00 s" in text


def test_the_tables_also_go_to_markdown(sweep: Path, tmp_path: Path) -> None:
    tables = tmp_path / "tables.md"
    assert main(["report", str(sweep), "-o", str(tmp_path / "r.html"), "--markdown", str(tables)]) == 0
    text = tables.read_text()
    assert text.count("### digits-mlp, ") == 2 and "topk:ratio=0.01,ef=true is first, in 1.50 s" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| topk:ratio=0.01,ef=true"))
    header = next(line for line in reversed(lines[: lines.index(row)]) if line.startswith("| method"))
    cells = dict(zip(_cells(header), _cells(row), strict=True))
    assert [cells[c] for c in ("time to target (s)", "reached", "speedup vs baseline")] == ["1.50", "3/3", "2.67x"]
    assert cells["speedup vs fastest torch hook"] == "1.60x"
    fewer = WIRE["torch:allreduce"] / WIRE["topk:ratio=0.01,ef=true"]  # over whole runs, against the baseline
    assert cells["fewer bytes"] == f"{fewer:.1f}x" and fewer > 1
    # a flat hook does not know the bytes across nodes: a column empty in every row is left out
    assert "across nodes MB/step" not in header
    assert "- failed: digits-mlp_torch-powersgd-rank=4_p2_1gbit_seed0: ValueError" in text


def test_a_single_run_makes_a_report(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    single = next(p for p in sweep.iterdir() if "torch-allreduce_p2_1gbit_seed0" in p.name)
    assert main(["report", str(single), "-o", str(tmp_path / "one.html")]) == 0
    assert f"report: {tmp_path / 'one.html'}" in capsys.readouterr().out
    text = (tmp_path / "one.html").read_text()
    assert "Nothing beats torch:allreduce here" in text and text.count("<svg") == 2
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "nowhere")])


# -- in a browser ---------------------------------------------------------------------------------


def _chromium() -> str | None:
    """Debian's chromium, installed with apt-get when missing (None where it cannot be)."""
    found = shutil.which("chromium")
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "timeout": 600}
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, **quiet).returncode == 0:  # type: ignore[call-overload]
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, check=False, **quiet)  # type: ignore[call-overload]
    return shutil.which("chromium")


@pytest.mark.timeout(900)
def test_the_page_renders_in_headless_chromium(sweep: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium, and it could not be installed here (apt-get install chromium needs root)")
    _page(sweep, tmp_path)
    page = f"file://{tmp_path / 'report.html'}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,3000"]
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", page], check=True, capture_output=True, timeout=120)
    dom = subprocess.run([browser, *flags, "--dump-dom", page], check=True, capture_output=True, timeout=120).stdout
    assert dom.decode().count("<svg") == 4  # parsed as SVG elements by the browser, every chart
    from matplotlib import image

    pixels = image.imread(str(shot))
    assert pixels.shape[0] == 3000 and pixels.shape[1] == 1400
    assert float(pixels[..., :3].std()) > 0.05  # not blank: text, tables and charts
    assert (pixels[..., :3].min(axis=2) < 0.5).mean() > 0.01  # a share of dark pixels (text and lines)
    # every table fits a laptop's 1366 pixels (a scroll bar's 15 less) without scrolling: a copy of the
    # page with a script that measures the tables at their narrowest (min-content) and the page
    measure = (
        "<script>document.title = [...document.querySelectorAll('table')].map(t => "
        "{t.style.width = 'min-content'; return t.offsetWidth}).join(' ') + ' ' + "
        "document.documentElement.scrollWidth;</script></body>"
    )
    measured = tmp_path / "measured.html"
    measured.write_text((tmp_path / "report.html").read_text().replace("</body>", measure))
    laptop = [*flags[:-1], "--window-size=1351,800", "--dump-dom", f"file://{measured}"]
    title = re.search(r"<title>([\d ]+)</title>", subprocess.run([browser, *laptop], check=True, capture_output=True,
                                                                  timeout=120).stdout.decode())  # fmt: skip
    assert title is not None, "the measuring script did not run"
    *tables, whole = (int(w) for w in title.group(1).split())
    assert len(tables) == 3 and max(tables) <= 1351 - 32 and whole <= 1351, (tables, whole)


def test_parallel_modes_are_groups_of_their_own_and_unreadable_runs_are_listed(tmp_path: Path) -> None:
    """A DDP and an FSDP2 run of the same hook and seed are two groups, each against its own
    baseline, not one method of "2/2 seeds"; a cut-short, a garbage and a non-record run.json are
    listed with the reason (in the page, its count and the Markdown), never silently dropped."""
    _write_run(tmp_path, "torch:allreduce", "loopback", 0)
    _write_run(tmp_path, "torch:fp16", "loopback", 0)
    _write_run(tmp_path, "torch:fp16", "loopback", 0, parallel="fsdp")
    _write_run(tmp_path, "torch:reduce_scatter", "loopback", 0, parallel="fsdp")
    for name, text in (("cut", '{"name": "cut", "sta'), ("garbage", "\x00\x01 not json"), ("list", "[1, 2]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(text)
    runs = records.load(str(tmp_path))
    groups = analysis.analyze(runs)
    assert sorted(g.title for g in groups) == ["digits-mlp, loopback, 2 ranks", "digits-mlp, loopback, 2 ranks, fsdp"]
    for group in groups:
        assert all(len(m.runs) == 1 for m in group.methods), group.title
    fsdp = next(g for g in groups if g.parallel == "fsdp")
    assert fsdp.baseline == "torch:reduce_scatter" and {m.hook for m in fsdp.methods} == {
        "torch:fp16", "torch:reduce_scatter"}  # fmt: skip
    unreadable = {r.name: r.error for r in runs if r.status == "unreadable"}
    assert set(unreadable) == {"cut", "garbage", "list"}
    assert "JSONDecodeError" in (unreadable["cut"] or "") and "a JSON list" in (unreadable["list"] or "")
    assert main(["report", str(tmp_path), "--markdown", str(tmp_path / "report.md")]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "3 unreadable (listed at the end)" in page and "Runs that could not be read (3)" in page
    assert "- unreadable: cut: run.json unreadable: JSONDecodeError" in (tmp_path / "report.md").read_text()


def _write_step_time_run(root: Path, hook: str, seed: int, steps_per_s: float) -> None:
    """A finished run of the synthetic task: no evaluation, its headline the steps per second."""
    name = f"synthetic-mlp_{re.sub(r'[^A-Za-z0-9._=+]+', '-', hook)}_p2_loopback_seed{seed}"
    record = {
        "name": name, "world_size": 2, "status": "finished",
        "config": {"task": "synthetic", "hook": hook, "network": "loopback", "ranks": 2, "seed": seed},
        "task": {"name": "synthetic", "model": "mlp", "headline": "steps_per_s"},
        "environment": {"cpu": "Fixture CPU", "cpus": 2, "torch": "2.13.0", "backend": "gloo"},
        "metrics": {"step": STEPS, "steps_per_s": steps_per_s, "train_time_s": STEPS / steps_per_s, "wire_bytes": 0},
    }  # fmt: skip
    runinfo.write(str(root / name), record)
    points = [{"kind": "train", "step": s, "time_s": s / steps_per_s, "wire_bytes": 0, "loss": 2.3}
              for s in range(10, STEPS + 1, 10)]  # fmt: skip
    with open(root / name / "curves.jsonl", "w") as file:
        file.writelines(json.dumps(p) + "\n" for p in points)


def test_a_step_time_study_compares_steps_per_second_without_a_target(tmp_path: Path) -> None:
    """The synthetic task has no evaluation: its runs compare by steps per second (no target for the
    baseline to miss, no time to reach one), the fastest named with its ratio to the baseline's."""
    for seed, (base, fp16) in enumerate(((20.0, 30.0), (22.0, 33.0))):
        _write_step_time_run(tmp_path, "torch:allreduce", seed, base)
        _write_step_time_run(tmp_path, "fp16", seed, fp16)
    (group,) = analysis.analyze(records.load(str(tmp_path)))
    assert group.baseline == "torch:allreduce" and group.target is None
    fp16 = group.method("fp16")
    assert fp16 is not None and fp16.speedup_vs_baseline == pytest.approx(31.5 / 21.0)
    assert fp16.final_p is not None and fp16.time_to_target is None and not fp16.times_to_target
    assert group.verdict.startswith("A step-time study")
    assert "fp16 is fastest: 31.5 steps_per_s, 1.50x torch:allreduce's" in group.verdict
    assert main(["report", str(tmp_path), "--markdown", str(tmp_path / "report.md")]) == 0
    assert "not reached" not in (tmp_path / "report.md").read_text()


# -- honest verdicts ------------------------------------------------------------------------------


def _write_timed_run(
    root: Path, hook: str, seed: int, step_s: float, reach_at: int, *, final: float = 0.96,
    compute_ms: float = 1.0, eval_samples: int | None = None, network: str = "1gbit",
) -> None:  # fmt: skip
    """A finished run that evaluates every 10 steps of ``step_s`` seconds each, its accuracy first at
    the target (0.955 against a baseline ending at 0.96) at evaluation ``reach_at``, ``final`` at the end."""
    name = f"{LABEL}_{re.sub(r'[^A-Za-z0-9._=+]+', '-', hook)}_p2_{network}_seed{seed}"
    evaluations = 8
    accuracy = [0.5 + 0.05 * i for i in range(reach_at)] + [0.956] * (evaluations - 1 - reach_at) + [final]
    points = [{"kind": "eval", "step": 10 * i, "time_s": 10 * i * step_s, "wire_bytes": 0, "accuracy": a, "loss": 1 - a}
              for i, a in enumerate(accuracy)]  # fmt: skip
    steps = 10 * (evaluations - 1)
    record = {
        "name": name, "world_size": 2, "status": "finished",
        "config": {"task": "digits", "hook": hook, "network": network, "ranks": 2, "seed": seed},
        "task": {"name": "digits", "model": "mlp", "headline": "eval_accuracy", "eval_samples": eval_samples},
        "metrics": {"step": steps, "eval_accuracy": final, "train_time_s": steps * step_s, "wire_bytes": 0,
                    "compute_ms": compute_ms},
    }  # fmt: skip
    runinfo.write(str(root / name), record)
    with open(root / name / "curves.jsonl", "w") as file:
        file.writelines(json.dumps(p) + "\n" for p in points)


def _study(root: Path, methods: dict[str, tuple[list[float], int]], **options: Any) -> analysis.Group:
    """One group of three seeds per method: its seconds per step, seed by seed, and the evaluation
    at which it first meets the target."""
    for hook, (step_s, reach_at) in methods.items():
        for seed, seconds in enumerate(step_s):
            _write_timed_run(root, hook, seed, seconds, reach_at, **options)
    (group,) = analysis.analyze(records.load(str(root)))
    return group


def test_a_gain_inside_the_noise_is_no_headline(tmp_path: Path) -> None:
    """fp16 reaches the target 1.03x sooner in the mean, its seeds' times spread across the
    baseline's: the verdict leads with the noise, not with fp16; a clear gain leads with the method."""
    group = _study(tmp_path / "noise", {"torch:allreduce": ([0.040, 0.050, 0.060], 4),
                                        "fp16": ([0.035, 0.052, 0.058], 4)})  # fmt: skip
    fp16 = group.method("fp16")
    assert fp16 is not None and fp16.speedup_vs_baseline == pytest.approx(0.05 / (0.145 / 3))
    assert fp16.baseline_p == pytest.approx(_welch_p([1.4, 2.08, 2.32], [1.6, 2.0, 2.4]))
    assert group.verdict.startswith("Within the noise of torch:allreduce: nothing reaches the target (95.50%)")
    first = group.verdict.split(". ")[0]
    assert "fp16" not in first and not re.search(r"x sooner", group.verdict)
    assert f"(1.03x, Welch p = {fp16.baseline_p:.2f} over the seeds: within the noise)" in group.verdict

    clear = _study(tmp_path / "clear", {"torch:allreduce": ([0.050, 0.051, 0.049], 4),
                                        "topk:ratio=0.01,ef=true": ([0.025, 0.026, 0.024], 4)})  # fmt: skip
    assert clear.verdict.startswith(
        "topk:ratio=0.01,ef=true reaches the target (95.50%) first, in 1.00 s: 2.00x sooner than torch:allreduce "
        "(Welch p < 0.001)"
    )


def test_a_slower_step_that_wins_by_fewer_steps_is_said_before_the_gain(tmp_path: Path) -> None:
    """top-k's steps take 50 ms against the all-reduce's 45, and it gets to the target in half the
    steps: the verdict says the slower step and the fewer steps before "sooner"."""
    group = _study(tmp_path, {"torch:allreduce": ([0.0450, 0.0452, 0.0448], 6),
                              "topk:ratio=0.01,ef=true": ([0.0500, 0.0502, 0.0498], 3)})  # fmt: skip
    topk = group.method("topk:ratio=0.01,ef=true")
    assert topk is not None and topk.steps_to_target == 30 and topk.step_ms == pytest.approx(50.0)
    assert group.verdict.startswith(
        "topk:ratio=0.01,ef=true takes slower steps than torch:allreduce (50.00 ms against 45.00 ms) but fewer of "
        "them (30 against 60), and reaches the target (95.50%) first, in 1.50 s: 1.80x sooner than torch:allreduce"
    )
    assert group.verdict.index("slower") < group.verdict.index("sooner")


def test_contradicting_figures_and_ties_of_a_coarse_evaluation_are_explained(tmp_path: Path) -> None:
    """A compute above its step is flagged with its likely cause (in the note and the cell); methods
    ending at the same accuracy seed for seed are explained by the evaluation's size."""
    for hook, compute_ms in (("torch:allreduce", 10.0), ("fp16", 60.0), ("bf16", 10.0)):
        for seed, seconds in enumerate((0.040, 0.050, 0.060)):
            final = (0.94, 0.95, 0.96)[seed]
            _write_timed_run(tmp_path, hook, seed, seconds, 4, final=final, compute_ms=compute_ms, eval_samples=397)
    (group,) = analysis.analyze(records.load(str(tmp_path)))
    above, tie = group.notes
    assert above.startswith("fp16: compute ms (60.00) is above step ms (50.00)") and "busier" in above
    assert tie.startswith("3 methods (bf16, fp16, torch:allreduce) end at exactly the same accuracy, seed for seed")
    assert "397 samples" in tie and "steps of 0.25 points (one sample)" in tie
    fp16 = group.method("fp16")
    assert fp16 is not None
    cells = dict(zip(page.HEADER, page.cells_of(group, fp16), strict=True))
    assert cells["compute ms"] == "60.00 (!)" and cells["p vs baseline"] == "1.000"
    assert main(["report", str(tmp_path), "--markdown", str(tmp_path / "report.md")]) == 0
    assert f"- note: {tie}" in (tmp_path / "report.md").read_text()
    assert "compute ms (60.00) is above step ms (50.00)" in (tmp_path / "report.html").read_text()
    # distinct finals and consistent times: nothing to say
    alone = tmp_path / "clean"
    for seed, final in enumerate((0.95, 0.96, 0.97)):
        _write_timed_run(alone, "torch:allreduce", seed, 0.05, 4, final=final, eval_samples=397)
    assert analysis.analyze(records.load(str(alone)))[0].notes == []


def test_a_step_time_study_within_the_noise_names_no_fastest_method(tmp_path: Path) -> None:
    for seed, (base, fp16) in enumerate(((20.0, 24.0), (25.0, 21.0), (22.0, 23.0))):
        _write_step_time_run(tmp_path, "torch:allreduce", seed, base)
        _write_step_time_run(tmp_path, "fp16", seed, fp16)
    (group,) = analysis.analyze(records.load(str(tmp_path)))
    assert "Within the noise of torch:allreduce: nothing is measurably faster here" in group.verdict
    assert "is fastest" not in group.verdict


def test_a_method_tied_with_the_baseline_does_not_beat_it(tmp_path: Path) -> None:
    group = _study(tmp_path, {"torch:allreduce": ([0.040, 0.050, 0.060], 4), "fp16": ([0.040, 0.050, 0.060], 4)})
    assert group.verdict.startswith(
        "Nothing beats torch:allreduce here: it reaches the target (95.50%) first, in 2.00 s"
    )
