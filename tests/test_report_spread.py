"""``gradcomp report``'s section "Across the groups" (``experiments/report/spread.py``): each method's
change against each group's baseline, seed-paired, over a grid of groups, from run records whose
final metrics and bytes are known, against figures worked out by hand here."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from gradcomp.cli import main
from gradcomp.experiments.report import analysis, page, spread
from gradcomp.experiments.report.records import Run
from tests.test_report import _cells, _write_run

BASELINE = "torch:allreduce"
QUANTIZE = "quantize:bits=4"
TOPK = "topk:ratio=0.01,ef=true"
STEPS = 100
BASELINE_WIRE = 4e6
"""The baseline's bytes per step, in every group."""
# Per group (a cell of the grid): each method's final perplexity by seed, and its bytes per step.
PERPLEXITY = {
    "char-b32-s150": {BASELINE: ([10.0, 12.0, 14.0], BASELINE_WIRE), QUANTIZE: ([10.5, 12.0, 14.7], 5e5),
                      TOPK: ([9.0, 9.0, 9.0], 4e4)},
    "char-b32-s300": {BASELINE: ([20.0, 20.0, 20.0], BASELINE_WIRE), QUANTIZE: ([19.0, 21.0, 20.0], 1e6)},
    "gpt12-b64-s300": {BASELINE: ([50.0, 40.0, 60.0], BASELINE_WIRE), QUANTIZE: ([55.0, 42.0, 60.0], 4e5)},
}  # fmt: skip
# By hand, quantize's seed-paired changes in percent of the baseline's seed (positive: worse):
# char-b32-s150 +5, 0, +5 (mean 10/3); char-b32-s300 -5, +5, 0 (mean 0); gpt12-b64-s300 +10, +5, 0 (mean 5).
QUANTIZE_CHANGES = {"char-b32-s150": 10 / 3, "char-b32-s300": 0.0, "gpt12-b64-s300": 5.0}


def _run(label: str, hook: str, seed: int, final: float, wire: float, *, key: str = "eval_perplexity",
         status: str = "finished", network: str = "loopback") -> Run:  # fmt: skip
    """A run's record as :func:`records.load` reads it: its final metric and the bytes it sent."""
    metrics = {"step": STEPS, key: final, "train_time_s": 10.0, "wire_bytes": STEPS * wire}
    return Run(f"{label}_{hook}_seed{seed}", label, hook, network, 2, seed, status, metric=key,
               metrics=metrics if status == "finished" else {})  # fmt: skip


def _grid(table: dict[str, dict[str, tuple[list[float], float]]], key: str = "eval_perplexity") -> list[Run]:
    return [_run(label, hook, seed, final, wire, key=key)
            for label, methods in table.items() for hook, (finals, wire) in methods.items()
            for seed, final in enumerate(finals)]  # fmt: skip


def _where(seed: spread.SeedChange | None) -> tuple[object, ...]:
    assert seed is not None
    return (seed.group, seed.seed, seed.change, seed.paired)


def test_a_method_across_three_groups_its_mean_worst_group_worst_seed_and_bytes() -> None:
    groups = analysis.analyze(_grid(PERPLEXITY), tolerance=4.0)
    (table,) = spread.across_groups(groups, tolerance=4.0)
    assert table.groups == tuple(PERPLEXITY) and table.baselines == (BASELINE,)  # labels alone: one network
    assert not table.metric.higher_is_better and table.unit == "%" and table.worse == "positive"
    (quantize,) = table.methods  # top-k ran in one group only: left out
    assert quantize.hook == QUANTIZE and (quantize.groups, quantize.finished, quantize.runs) == (3, 9, 9)
    assert {c.group: c.change for c in quantize.changes} == pytest.approx(QUANTIZE_CHANGES)
    assert quantize.mean_change == pytest.approx((10 / 3 + 0 + 5) / 3)
    assert quantize.worst_group is not None
    assert (quantize.worst_group.group, quantize.worst_group.change) == ("gpt12-b64-s300", pytest.approx(5.0))
    assert _where(quantize.worst_seed) == ("gpt12-b64-s300", 0, pytest.approx(10.0), True)
    # the baseline's 4 MB a step over quantize's 0.5, 1 and 0.4 MB
    assert (quantize.fewest_fewer_bytes, quantize.most_fewer_bytes) == (pytest.approx(4.0), pytest.approx(10.0))
    assert quantize.within_tolerance == 2  # +3.3% and 0% are within 4%, +5% is not
    assert spread.across_groups(groups, tolerance=5.0)[0].methods[0].within_tolerance == 3  # +5% at the edge
    assert spread.across_groups(groups, tolerance=0.5)[0].methods[0].within_tolerance == 1

    header = page.spread_header(table)
    assert header[3] == "mean change (%)" and header[-1] == "within 4%"
    cells = dict(zip(header, page.spread_cells(table, quantize), strict=True))
    assert cells == {
        "method": QUANTIZE, "groups": "3", "seeds": "9/9", "mean change (%)": "+2.78%",
        "worst group": "+5.00% (gpt12-b64-s300)", "worst seed": "+10.00% (gpt12-b64-s300, seed 0)",
        "fewer bytes, least": "4.0x", "fewer bytes, most": "10.0x", "within 4%": "2/3",
    }  # fmt: skip


def test_an_accuracy_changes_in_points_and_its_worst_is_the_lowest() -> None:
    """Accuracy: a change in percentage points, negative worse; the worst group and seed are the lowest."""
    finals = {
        "digits-a": {BASELINE: ([0.90, 0.92], BASELINE_WIRE), QUANTIZE: ([0.89, 0.92], 1e6)},  # -1, 0: -0.5
        "digits-b": {BASELINE: ([0.80, 0.80], BASELINE_WIRE), QUANTIZE: ([0.83, 0.77], 1e6)},  # +3, -3: 0
    }
    (table,) = spread.across_groups(analysis.analyze(_grid(finals, "eval_accuracy")), tolerance=0.5)
    (quantize,) = table.methods
    assert table.unit == " pp" and table.worse == "negative"
    assert quantize.mean_change == pytest.approx(-0.25)
    assert quantize.worst_group is not None and quantize.worst_group.group == "digits-a"
    assert quantize.worst_group.change == pytest.approx(-0.5)
    assert _where(quantize.worst_seed) == ("digits-b", 1, pytest.approx(-3.0), True)
    assert quantize.within_tolerance == 2  # -0.5 pp is at the edge of 0.5 points
    cells = page.spread_cells(table, quantize)
    assert cells[3:6] == ["-0.25 pp", "-0.50 pp (digits-a)", "-3.00 pp (digits-b, seed 1)"]
    assert page.spread_header(table)[-1] == "within 0.5 pp"


def test_seeds_pair_by_seed_number_and_fall_back_to_the_means() -> None:
    """The method's seed 1 against the baseline's seed 1, whatever the runs' order; a seed the
    baseline lacks is left out; where no seed pairs up, the group compares the means."""
    runs = [
        _run("paired", BASELINE, 0, 10.0, BASELINE_WIRE), _run("paired", BASELINE, 1, 20.0, BASELINE_WIRE),
        _run("paired", QUANTIZE, 1, 20.0, 1e6), _run("paired", QUANTIZE, 0, 11.0, 1e6),
        _run("paired", QUANTIZE, 2, 99.0, 1e6),  # no baseline seed 2: left out of the change
        _run("unpaired", BASELINE, 0, 10.0, BASELINE_WIRE), _run("unpaired", BASELINE, 1, 20.0, BASELINE_WIRE),
        _run("unpaired", QUANTIZE, 3, 11.0, 1e6), _run("unpaired", QUANTIZE, 4, 20.0, 1e6),
    ]  # fmt: skip
    (table,) = spread.across_groups(analysis.analyze(runs), tolerance=0.5)
    (quantize,) = table.methods
    paired, unpaired = quantize.changes
    # paired: seed 0 +10%, seed 1 0% (mean 5%); the means' change (15.5 against 15) would be 3.33%
    assert paired.paired and [(s.seed, s.change) for s in paired.seeds] == [(1, 0.0), (0, pytest.approx(10.0))]
    assert paired.change == pytest.approx(5.0)
    assert paired.change != pytest.approx(100 * (statistics.fmean([11.0, 20.0]) - 15.0) / 15.0)
    # unpaired: the means, 15.5 against 15; each seed against the baseline's mean
    assert not unpaired.paired and unpaired.change == pytest.approx(100 * 0.5 / 15)
    assert [(s.seed, s.change) for s in unpaired.seeds] == [(3, pytest.approx(-100 * 4 / 15)),
                                                            (4, pytest.approx(100 * 5 / 15))]  # fmt: skip
    assert quantize.worst_seed is not None and quantize.worst_seed.group == "unpaired"
    assert page.spread_cells(table, quantize)[5] == "+33.33% (unpaired, seed 4, vs the baseline's mean)"
    assert quantize.finished == 5 and quantize.groups == 2


def test_one_group_another_metric_and_a_method_in_one_group_show_no_section(tmp_path: Path) -> None:
    one = {"char-b32-s150": PERPLEXITY["char-b32-s150"]}
    runs = _grid(one)
    groups = analysis.analyze(runs)
    assert spread.across_groups(groups, tolerance=0.5) == []
    assert "Across the groups" not in page.markdown(groups, runs)
    # two groups, but by different metrics: nothing to compare across them
    other = _grid({"digits-a": {BASELINE: ([0.9], BASELINE_WIRE), QUANTIZE: ([0.9], 1e6)}}, "eval_accuracy")
    assert spread.across_groups(analysis.analyze(runs + other), tolerance=0.5) == []
    # two groups of one metric that share only their baseline: no row, no section
    nothing_shared = _grid({"char-b32-s300": {BASELINE: ([20.0], BASELINE_WIRE), "torch:fp16": ([20.0], 2e6)}})
    assert spread.across_groups(analysis.analyze(runs + nothing_shared), tolerance=0.5) == []
    # the page, from run directories: one group (one network) has no section
    for seed in range(2):
        _write_run(tmp_path, BASELINE, "1gbit", seed)
        _write_run(tmp_path, TOPK, "1gbit", seed)
    assert main(["report", str(tmp_path), "--markdown", str(tmp_path / "report.md")]) == 0
    assert "Across the groups" not in (tmp_path / "report.html").read_text()
    assert "Across the groups" not in (tmp_path / "report.md").read_text()


def test_unfinished_runs_count_in_the_groups_column_and_a_group_without_figures_is_not_compared() -> None:
    runs = _grid({label: PERPLEXITY[label] for label in ("char-b32-s150", "char-b32-s300")})
    runs += [_run("gpt12-b64-s300", BASELINE, 0, 50.0, BASELINE_WIRE),
             _run("gpt12-b64-s300", QUANTIZE, 0, 0.0, 4e5, status="failed")]  # fmt: skip
    (table,) = spread.across_groups(analysis.analyze(runs), tolerance=0.5)
    (quantize,) = table.methods
    assert (quantize.groups, quantize.finished, quantize.runs, len(quantize.changes)) == (3, 6, 7, 2)
    assert quantize.mean_change == pytest.approx((10 / 3 + 0) / 2)
    assert page.spread_cells(table, quantize)[1:3] == ["3 (2 compared)", "6/7"]
    assert page.spread_cells(table, quantize)[-1] == "1/2"


def test_the_section_is_on_the_page_and_last_in_the_markdown(tmp_path: Path) -> None:
    """Two networks of one task: the groups are named by their network, the section follows the
    verdicts on the page and closes the Markdown."""
    for network in ("1gbit", "loopback"):
        for seed in range(3):
            _write_run(tmp_path, BASELINE, network, seed)
            _write_run(tmp_path, TOPK, network, seed)
    assert main(["report", str(tmp_path), "--markdown", str(tmp_path / "report.md")]) == 0
    html = (tmp_path / "report.html").read_text()
    assert html.index("<h2>Verdicts</h2>") < html.index('<h2 id="across">Across the groups</h2>')
    assert html.index("Across the groups") < html.index('<h2 id="group-1">')
    text = (tmp_path / "report.md").read_text()
    assert text.index("### Across the groups") > text.index("### digits-mlp, loopback")
    lines = text.splitlines()
    row, header = lines[-1], lines[-3]  # one row, under the header and its rule
    cells = dict(zip(_cells(header), _cells(row), strict=True))
    # top-k's finals (test_report.ACCURACY) 0.96, 0.96, 0.958 against 0.95, 0.96, 0.97: +1, 0, -1.2 points
    assert cells["method"] == TOPK and cells["groups"] == "2" and cells["seeds"] == "6/6"
    assert cells["mean change (pp)"] == "-0.07 pp" and cells["worst group"] == "-0.07 pp (1gbit)"
    assert cells["worst seed"] == "-1.20 pp (1gbit, seed 2)"
    assert cells["fewer bytes, least"] == cells["fewer bytes, most"] == "50.0x" and cells["within 0.5 pp"] == "2/2"
