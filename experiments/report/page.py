"""The report as one HTML page: inline CSS and SVG, no script, no external URL (it opens offline)."""

from __future__ import annotations

import datetime
import html
from collections.abc import Sequence

from gradcomp.bench.report import markdown_table
from gradcomp.experiments.report import plots
from gradcomp.experiments.report.analysis import Group, MethodRuns
from gradcomp.experiments.report.records import Run
from gradcomp.experiments.report.spread import MethodSpread, Spread, across_groups

STYLE = """
body { font-family: sans-serif; margin: 2em auto; padding: 0 1em; max-width: 1400px; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { font-size: 1.3em; margin-top: 2.2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.86em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.4em; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; white-space: normal; vertical-align: bottom; } td.name, th.name { text-align: left; }
td.name { white-space: normal; min-width: 11em; max-width: 16em; overflow-wrap: break-word; }
.verdict { font-size: 1.08em; background: #eef5ff; border-left: 4px solid #1f77b4; padding: 0.5em 0.8em; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: -0.1em; }
.scroll { overflow-x: auto; } .note { color: #555; font-size: 0.9em; } .failed { color: #a00; }
.flag { border-left: 4px solid #d62728; padding-left: 0.6em; }
figure { margin: 0.5em 0; }
"""


def render(groups: Sequence[Group], runs: Sequence[Run], source: str, tolerance: float, baseline: str | None) -> str:
    """The whole page for ``groups`` (analysed from ``runs``, read from ``source``)."""
    colours = plots.palette([m.hook for g in groups for m in g.methods])
    finished = sum(r.status == "finished" for r in runs)
    settings = f"target: the baseline's final metric less {tolerance:g} (percentage points for accuracy, else percent)"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gradcomp report: {_e(source)}</title><style>{STYLE}</style></head><body>",
        f"<h1>Time to accuracy: {_e(source)}</h1>",
        f'<p class="note">{len(runs)} runs, {finished} finished{_unreadable_count(runs)}, in {len(groups)} group(s); '
        f"{_e(settings)}; "
        f"baseline {_e(baseline or 'torch:allreduce, else allreduce, torch:reduce_scatter or none')}. Generated "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by gradcomp report.</p>",
        _environment(runs),
        "<h2>Verdicts</h2><ul>",
        *(f"<li><b>{_e(g.title)}</b>: {_e(g.verdict)}</li>" for g in groups),
        "</ul>",
    ]
    parts += _across(across_groups(groups, tolerance), colours)
    for number, group in enumerate(groups, 1):
        parts += _section(number, group, colours)
    missing = [r for r in runs if r.status == "missing"]
    if missing:
        parts += [f"<h2>Runs not made yet ({len(missing)})</h2>", '<p class="note">',
                  ", ".join(_e(r.name) for r in missing), "</p>"]  # fmt: skip
    unreadable = [r for r in runs if r.status == "unreadable"]
    if unreadable:
        parts += [f'<h2 class="failed">Runs that could not be read ({len(unreadable)})</h2><ul class="failed">',
                  *(f"<li>{_e(r.name)}: {_e(r.error or '')}</li>" for r in unreadable), "</ul>"]  # fmt: skip
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _unreadable_count(runs: Sequence[Run]) -> str:
    count = sum(r.status == "unreadable" for r in runs)
    return f", {count} unreadable (listed at the end)" if count else ""


def _section(number: int, group: Group, colours: dict[str, str]) -> list[str]:
    parts = [f'<h2 id="group-{number}">{_e(group.title)}</h2>', f'<p class="verdict">{_e(group.verdict)}</p>']
    if group.metric is None:
        return parts
    target = group.metric.format(group.target) if group.target is not None else "none"
    parts.append(
        f'<p class="note">Metric: {_e(group.metric.key)}; baseline: {_e(group.baseline or "none")}; '
        f"target: {_e(target)}. Time to target: training time (steps only) at the first evaluation where the "
        "mean over seeds meets it (reached: by how many seeds on their own). Step time: compute (the "
        "same step without communication) + compression (compress and decompress, where the hook times "
        "them) + exposed communication (the rest).</p>"
    )
    parts.append(_table(group, colours))
    parts += [f'<p class="note flag">{_e(note)}</p>' for note in group.notes]
    failed = [r for m in group.methods for r in m.failed]
    if failed:
        parts.append('<p class="failed"><b>Failed runs</b>:</p><ul class="failed">')
        parts += [f"<li>{_e(r.name)}: {_e(r.reason)}</li>" for r in failed]
        parts.append("</ul>")
    unfinished = [r for m in group.methods for r in m.unfinished]
    if unfinished:
        listed = ", ".join(f"{_e(r.name)} ({_e(r.status)})" for r in unfinished)
        parts.append(f'<p class="note"><b>Not finished</b> (left out of the figures): {listed}</p>')
    if any(m.time_to_target is not None for m in group.methods):
        parts.append(f'<figure class="chart">{plots.time_to_target_figure(group, colours)}</figure>')
    if any(m.finished for m in group.methods):
        parts.append(f'<figure class="chart">{plots.curves_figure(group, colours)}</figure>')
    return parts


HEADER = (
    "method", "seeds", "final (mean ± std)", "95% CI", "p vs baseline", "time to target (s)", "reached",
    "speedup vs baseline", "p (time) vs baseline", "speedup vs fastest torch hook", "p (time) vs it",
    "wire MB/step", "across nodes MB/step", "fewer bytes",
    "compression", "step ms", "compute ms", "compress ms", "exposed comm ms",
)  # fmt: skip
COMPUTE_ABOVE_STEP = " (!)"
"""Marks a compute ms above its step ms (a note under the table says why)."""


def columns(group: Group) -> list[int]:
    """The columns of :data:`HEADER` the group's table shows, so that it fits a laptop's screen: those
    with a figure in some row (a column empty for every method, "across nodes" of flat hooks, says
    nothing), and "compression" only where it differs from "fewer bytes" in some row (warm-ups, a
    synchronization's skipped steps), and the fastest torch hook's columns only where it is not the
    baseline."""
    rows = [cells_of(group, m) for m in group.methods]
    hidden = set()
    compression, fewer = HEADER.index("compression"), HEADER.index("fewer bytes")
    if all(row[compression] == row[fewer] for row in rows):
        hidden.add(compression)
    if group.fastest_torch == group.baseline:  # the same figures as against the baseline
        hidden |= {HEADER.index("speedup vs fastest torch hook"), HEADER.index("p (time) vs it")}
    return [i for i in range(len(HEADER)) if i == 0 or (i not in hidden and any(row[i] != "-" for row in rows))]


def _table(group: Group, colours: dict[str, str]) -> str:
    shown = columns(group)
    head = "".join(f"<th{' class=name' if i == 0 else ''}>{_e(HEADER[i])}</th>" for i in shown)
    rows = [f"<table><tr>{head}</tr>"]
    for method in group.methods:
        every = cells_of(group, method)
        cells = [_e(every[i]) for i in shown]
        cells[0] = _name_cell(method.hook, cells[0], colours)
        row = "".join(f"<td{' class=name' if i == 0 else ''}>{c}</td>" for i, c in enumerate(cells))
        rows.append(f"<tr>{row}</tr>")
    rows.append("</table>")
    return '<div class="scroll">' + "\n".join(rows) + "</div>"


def _name_cell(hook: str, escaped: str, colours: dict[str, str]) -> str:
    """A method's name cell: its colour's swatch, its name (``escaped``) broken between options, its
    full canonical spec on hover."""
    swatch = f'<span class="swatch" style="background:{colours[hook]}"></span>'
    name = escaped.replace(",", ",<wbr>").replace(" over ", " over<wbr> ")  # a long spec breaks between options
    return f'{swatch}<span title="{_e(hook)}">{name}</span>'


def _across(tables: Sequence[Spread], colours: dict[str, str]) -> list[str]:
    """The section "Across the groups" (nothing where no two groups of one metric share a method)."""
    if not tables:
        return []
    parts = ['<h2 id="across">Across the groups</h2>']
    for table in tables:
        parts.append(f'<p class="note">{_e(spread_note(table))}</p>')
        head = "".join(f"<th{' class=name' if i == 0 else ''}>{_e(h)}</th>" for i, h in enumerate(spread_header(table)))
        rows = [f"<table><tr>{head}</tr>"]
        for method in table.methods:
            cells = [_e(c) for c in spread_cells(table, method)]
            cells[0] = _name_cell(method.hook, cells[0], colours)
            rows.append("<tr>" + "".join(f"<td{' class=name' if i == 0 else ''}>{c}</td>"
                                         for i, c in enumerate(cells)) + "</tr>")  # fmt: skip
        rows.append("</table>")
        parts.append('<div class="scroll">' + "\n".join(rows) + "</div>")
    return parts


def spread_header(table: Spread) -> list[str]:
    """The columns of an "Across the groups" table (a change's unit in its header)."""
    unit = table.unit.strip()
    return [
        "method", "groups", "seeds", f"mean change ({unit})", "worst group", "worst seed",
        "fewer bytes, least", "fewer bytes, most", f"within {table.tolerance:g}{table.unit}",
    ]  # fmt: skip


def spread_cells(table: Spread, method: MethodSpread) -> list[str]:
    """A method's row of an "Across the groups" table, as text (the columns of :func:`spread_header`)."""
    compared = len(method.changes)
    groups = f"{method.groups}" + ("" if compared == method.groups else f" ({compared} compared)")
    worst_group = worst_seed = "-"
    if method.worst_group is not None:
        worst_group = f"{table.format(method.worst_group.change)} ({method.worst_group.group})"
    if method.worst_seed is not None:
        seed = method.worst_seed
        unpaired = "" if seed.paired else ", vs the baseline's mean"
        worst_seed = f"{table.format(seed.change)} ({seed.group}, seed {seed.seed}{unpaired})"
    return [
        method.name,
        groups,
        f"{method.finished}/{method.runs}",
        table.format(method.mean_change),
        worst_group,
        worst_seed,
        _number(method.fewest_fewer_bytes, "{:.1f}x"),
        _number(method.most_fewer_bytes, "{:.1f}x"),
        f"{method.within_tolerance}/{compared}" if compared else "-",
    ]


def spread_note(table: Spread) -> str:
    """What an "Across the groups" table shows and how a row is computed, in a sentence or three."""
    metric = table.metric
    unit = "percentage points" if metric.percent else "percent of the baseline's value"
    return (
        f"The final {metric.name} ({metric.key}) of each method found in two groups or more, against each "
        f"group's baseline ({', '.join(table.baselines)}), in the groups {', '.join(table.groups)}. A change is "
        f"in {unit} ({table.worse} is worse). A group's change is the mean over seeds of seed s against the "
        "baseline's seed s (seeds without a pair left out; where none pairs up, against the baseline's mean); "
        "mean change: over the groups; worst group and worst seed: the worst of those, with where. Fewer bytes: "
        "the least and the most over the groups. Within: the groups whose change is within the target "
        f"tolerance ({table.tolerance:g}{table.unit})."
    )


def cells_of(group: Group, method: MethodRuns) -> list[str]:
    """A method's row of the group's table, as text (the columns of :data:`HEADER`)."""
    assert group.metric is not None
    metric = group.metric
    std = method.final_std
    final = "-" if method.final_mean is None else f"{metric.format(method.final_mean)} ± {metric.format(std)}"
    ci = "-"
    if method.final_ci:  # 90.30 to 98.11%: one unit for both ends, a narrower column
        low = metric.format(method.final_ci[0]).removesuffix("%" if metric.percent else "")
        ci = f"{low} to {metric.format(method.final_ci[1])}"
    compute, step = method.mean("compute_ms"), method.step_ms
    above = compute is not None and step is not None and compute > step
    return [
        method.name + (" (baseline)" if method.hook == group.baseline else ""),
        f"{len(method.finished)}/{len(method.runs)}",
        final,
        ci,
        _p(method.final_p),
        _time_to_target(method),
        f"{method.reached}/{len(method.times_to_target)}" if method.times_to_target else "-",
        _number(method.speedup_vs_baseline, "{:.2f}x"),
        _p(method.baseline_p),
        _number(method.speedup_vs_torch, "{:.2f}x"),
        _p(method.time_p),
        _number(method.wire_mb_per_step, "{:.3f}"),
        _number(method.inter_node_mb_per_step, "{:.3f}"),
        _number(method.fewer_bytes, "{:.1f}x"),
        _number(method.mean("compression_ratio"), "{:.1f}x"),
        _number(method.step_ms, "{:.2f}"),
        _number(compute, "{:.2f}") + (COMPUTE_ABOVE_STEP if above else ""),
        _number(method.compress_ms, "{:.2f}"),
        _number(method.exposed_ms, "{:.2f}"),
    ]


def markdown(groups: Sequence[Group], runs: Sequence[Run] = (), tolerance: float = 0.5) -> str:
    """The verdicts and tables as Markdown (for documents that quote a report: ``--markdown FILE``),
    the runs of ``runs`` that could not be read, and last the section "Across the groups" (by the
    target ``tolerance``) where it has a row."""
    parts = [f"- unreadable: {r.name}: {r.error}" for r in runs if r.status == "unreadable"]
    parts += [""] if parts else []
    for group in groups:
        parts += [f"### {group.title}", "", group.verdict, ""]
        if group.metric is None:
            continue
        target = group.metric.format(group.target) if group.target is not None else "none"
        parts += [f"Baseline {group.baseline or 'none'}, target {target} ({group.metric.key}).", ""]
        shown = columns(group)
        rows = [[cells[i] for i in shown] for cells in (cells_of(group, m) for m in group.methods)]
        parts += [markdown_table([HEADER[i] for i in shown], rows), ""]
        parts += [f"- note: {note}" for note in group.notes] + ([""] if group.notes else [])
        parts += [f"- failed: {r.name}: {r.reason}" for m in group.methods for r in m.failed]
        parts += [f"- not finished: {r.name} ({r.status})" for m in group.methods for r in m.unfinished]
        parts += [""] if any(m.failed or m.unfinished for m in group.methods) else []
    tables = across_groups(groups, tolerance)
    parts += ["### Across the groups", ""] if tables else []
    for table in tables:
        rows = [spread_cells(table, m) for m in table.methods]
        parts += [spread_note(table), "", markdown_table(spread_header(table), rows), ""]
    return "\n".join(parts)


def _time_to_target(method: MethodRuns) -> str:
    if method.time_to_target is not None:
        return f"{method.time_to_target:.2f}"
    if method.times_to_target:
        return "not reached"
    return "-"


def _p(value: float | None) -> str:
    return "-" if value is None else "<0.001" if value < 0.001 else f"{value:.3f}"


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def _environment(runs: Sequence[Run]) -> str:
    """The machine of the runs, as the first of them that recorded one says."""
    env = next((r.environment for r in runs if r.environment), None)
    if env is None:
        return ""
    facts = [
        f"{env.get('cpu', 'unknown CPU')} ({env.get('cpus', '?')} cores)",
        f"torch {env.get('torch', '?')}",
        f"gradcomp {env.get('gradcomp', '?')}",
        f"backend {env.get('backend', '?')}",
        f"{env.get('threads_per_rank', '?')} thread(s) per rank",
    ]
    return f'<p class="note">Machine: {_e(", ".join(facts))}.</p>'


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)
