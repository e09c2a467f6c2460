"""The fault study's page (``gradcomp.experiments.faults``): a faulted run beside its fault-free twin.

One self-contained HTML page, as the sweep report's (inline CSS and SVG, no script, no URL): the
evaluation accuracy of both runs against committed steps and against time, the participating
groups per step, the kill and the rejoin marked, and the comparison table (steps lost, step times
before, during and after the loss, bytes)."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from gradcomp.experiments.report import plots
from gradcomp.experiments.report.page import STYLE

RUNS = ("fault-free", "faulted")
COLOURS = {"fault-free": "#1f77b4", "faulted": "#d62728"}


def _evaluations(folder: Path, group: int) -> list[dict[str, Any]]:
    from gradcomp.experiments.faults import read_lines

    return [e for e in read_lines(folder).get(group, []) if e["kind"] == "eval"]


def _steps(folder: Path, group: int) -> list[dict[str, Any]]:
    from gradcomp.experiments.faults import read_lines

    return [e for e in read_lines(folder).get(group, []) if e["kind"] == "step"]


def figure(out: Path, observed: int, kill: int, at: int | None, restarted_at: int | None) -> str:
    """Accuracy against committed step and against time (group ``observed``'s evaluations), and the
    groups taking part in each of its steps, both runs on each chart."""
    charts, axes = plots.pyplot.subplots(1, 3, figsize=(13.5, 3.8), constrained_layout=True)
    for run in RUNS:
        folder = out / run
        if not folder.is_dir():
            continue
        evaluations = _evaluations(folder, observed)
        steps = _steps(folder, observed)
        colour = COLOURS[run]
        axes[0].plot([e["committed"] for e in evaluations], [100 * e["accuracy"] for e in evaluations],
                     color=colour, label=run, linewidth=1.6)  # fmt: skip
        axes[1].plot([e["time"] for e in evaluations], [100 * e["accuracy"] for e in evaluations], color=colour,
                     label=run, linewidth=1.6)  # fmt: skip
        known = [e for e in steps if e["participants"] is not None]
        axes[2].step([e["committed"] for e in known], [e["participants"] for e in known], where="post",
                     color=colour, label=run, linewidth=1.2)  # fmt: skip
    for ax in (axes[0], axes[2]):
        if at is not None:
            ax.axvline(at, color="black", linewidth=0.8, linestyle=":", label=f"group {kill} killed")
        if restarted_at is not None:
            ax.axvline(restarted_at, color="grey", linewidth=0.8, linestyle="--", label=f"group {kill} restarted")
    labels = [("committed step", "eval accuracy (%)"), ("time (s)", "eval accuracy (%)"),
              ("committed step", "groups taking part")]  # fmt: skip
    for ax, (xlabel, ylabel) in zip(axes, labels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[2].yaxis.set_major_locator(plots.matplotlib.ticker.MaxNLocator(integer=True))
    handles, names = axes[2].get_legend_handles_labels()
    charts.legend(handles, names, loc="outside lower center", ncol=len(names), frameon=False)
    return plots.svg(charts)


def render(out: Path, results: dict[str, Any], table: str) -> str:
    """The page for the study in ``out`` (its ``results`` as ``summary.json`` holds them, and the
    comparison as a Markdown ``table``)."""
    from gradcomp.experiments.faults import auto_text

    config = results["config"]
    observed = 0 if config["kill"] != 0 else 1
    faulted = results.get("faulted", {})
    at = faulted.get("killed_at")
    rows = [line.strip("|").split("|") for line in table.splitlines() if not line.startswith("|---")]
    head, body = rows[0], rows[1:]
    cells = "".join(f"<th>{html.escape(c.strip())}</th>" for c in head)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in row) + "</tr>" for row in body)
    method = config["hook"] if config["sync"] is None else f"{config['sync']} over {config['hook']}"
    setting = (f"{config['groups']} replica groups of one rank on {config['network']}, {config['task']}, "
               f"{method}, {config['steps']} steps, seed {config['seed']}; group {config['kill']} killed at step "
               f"{config['at']} and restarted {config['restart_after']} steps later")  # fmt: skip
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gradcomp fault study: {html.escape(str(out))}</title><style>{STYLE}</style></head><body>",
        f"<h1>A lost replica group: {html.escape(method)}</h1>",
        f'<p class="note">{html.escape(setting)}. Curves: group {observed}\'s evaluations.</p>',
        figure(out, observed, config["kill"], at, faulted.get("restarted_at")),
        f'<div class="scroll"><table><tr>{cells}</tr>{lines}</table></div>',
        *(f'<p class="note">{html.escape(line)}</p>' for line in auto_text(results).splitlines()),
        '<p class="note">Steps lost: run by a survivor but not committed. Step times: the survivors\' busy time '
        "(quorum, compute, averaging; without the pacing wait), median before, during (fewer groups than all "
        "took part) and after the loss, and the longest step during it.</p>",
        "</body></html>",
    ]) + "\n"  # fmt: skip


def write(out: Path, results: dict[str, Any], table: str) -> Path:
    """``out/report.html``."""
    path = out / "report.html"
    path.write_text(render(out, results, table))
    return path


def seeds_text(studies: dict[int, dict[str, Any]], figures: dict[str, Any], config: Any) -> str:
    """Across seeds, as Markdown: per seed both runs' final accuracy and the difference, then the
    mean difference with its 95% interval."""
    from gradcomp.experiments.faults import accuracy

    rows = ["| seed | fault-free | faulted | difference (pp) | steps during the loss | longest step ms |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for seed, results in studies.items():
        free, faulted = accuracy(results, "fault-free", config), accuracy(results, "faulted", config)
        difference = figures["difference_pp"].get(seed)
        longest = results["faulted"]["longest_step_ms_during_loss"]
        rows.append(f"| {seed} | {_f(free, '.4f')} | {_f(faulted, '.4f')} | {_f(difference, '+.2f')} | "
                    f"{results['faulted']['steps_during_loss']} | {_f(longest, '.0f')} |")  # fmt: skip
    interval = figures["interval_pp"]
    spread = "" if interval is None else f", 95% interval [{interval[0]:+.2f}, {interval[1]:+.2f}]"
    rows.append(f"\nfaulted less fault-free: mean {_f(figures['mean_pp'], '+.2f')} pp{spread}; the largest "
                f"|difference| {_f(figures['largest_pp'], '.2f')} pp over {len(studies)} seeds")  # fmt: skip
    return "\n".join(rows)


def write_seeds(out: Path, studies: dict[int, dict[str, Any]], figures: dict[str, Any], config: Any) -> Path:
    """``out/report.html`` across seeds: the table of :func:`seeds_text`, and each seed's own page."""
    links = " ".join(f'<a href="seed{seed}/report.html">seed {seed}</a>' for seed in studies)
    method = config.hook if config.sync is None else f"{config.sync} over {config.hook}"
    title = f"A lost replica group, over {len(studies)} seeds: {method}"
    return _summary_page(out, title, seeds_text(studies, figures, config), f"Per seed, its curves: {links}.")


def methods_text(methods: dict[str, dict[str, Any]]) -> str:
    """Several methods' studies side by side, as Markdown: each one's accuracy differences (faulted
    less fault-free) over its seeds."""
    rows = ["| method | seeds | mean difference (pp) | 95% interval | largest difference, either way (pp) |",
            "|---|---|---|---|---|"]  # fmt: skip
    for method, figures in methods.items():
        interval = figures["interval_pp"]
        shown = "-" if interval is None else f"[{interval[0]:+.2f}, {interval[1]:+.2f}]"
        name = method.replace("|", "\\|")  # auto's candidates: not the table's cells
        rows.append(f"| {name} | {len(figures['difference_pp'])} | {_f(figures['mean_pp'], '+.2f')} | {shown} | "
                    f"{_f(figures['largest_pp'], '.2f')} |")  # fmt: skip
    largest = max((f["largest_pp"] for f in methods.values() if f["largest_pp"] is not None), default=None)
    rows.append(f"\nthe largest |difference| of any method: {_f(largest, '.2f')} pp")
    return "\n".join(rows)


def write_methods(out: Path, methods: dict[str, dict[str, Any]], folders: dict[str, str]) -> Path:
    """``out/report.html`` across methods: the table of :func:`methods_text`, and each method's page."""
    links = " ".join(f'<a href="{html.escape(folders[m])}/report.html">{html.escape(m)}</a>' for m in methods)
    title = f"A lost replica group, {len(methods)} methods"
    return _summary_page(out, title, methods_text(methods), f"Per method, its page: {links}.")


def _summary_page(out: Path, title: str, text: str, note: str) -> Path:
    """``out/report.html``: a Markdown table and the line below it (``text``) as one page, ``note``
    (HTML, its text escaped by the caller) under it."""
    table, _, verdict = text.partition("\n\n")
    rows = [[cell.replace("\\|", "|").strip() for cell in re.split(r"(?<!\\)\|", line.strip("|"))]
            for line in table.splitlines() if not line.startswith("|---")]  # fmt: skip
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:])
    path = out / "report.html"
    path.write_text("\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gradcomp fault study: {html.escape(str(out))}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="verdict">{html.escape(verdict.strip())}</p>',
        f'<div class="scroll"><table><tr>{head}</tr>{body}</table></div>',
        f'<p class="note">{note}</p>',
        "</body></html>",
    ]) + "\n")  # fmt: skip
    return path


def _f(value: float | None, form: str) -> str:
    if value is None:
        return "-"
    text = format(value, form)
    return format(0.0, form) if text.startswith("-") and float(text) == 0 else text  # no "-0.00"
