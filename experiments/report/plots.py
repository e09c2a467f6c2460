"""The report's charts as inline SVG (matplotlib, no file, no font or URL to fetch).

Each method keeps one colour on every chart of a report (:func:`palette`); torch's hooks are drawn
dashed. Curves are means over seeds with a band from the least to the greatest seed.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

from gradcomp.experiments.report.analysis import Group, curve
from gradcomp.hooks.torch_hooks import is_torch_spec

try:
    import matplotlib

    matplotlib.use("Agg")  # no display: draw to memory
    from matplotlib import pyplot
except ImportError as error:  # the core installs without it
    raise ImportError("gradcomp report draws with matplotlib: pip install 'gradcomp[experiments]'") from error

COLOURS = (
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
    "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354",
)  # fmt: skip
"""Distinct colours (matplotlib's tab10, then more of its tab20b/c), one per method in a report."""
X_AXES = (
    ("step", "optimizer step", 1.0),
    ("time_s", "training time (s)", 1.0),
    ("wire_bytes", "sent per rank (MB)", 1e-6),
)
"""The x axes of every curve: key in the curve points, axis label (with its unit), scale."""


def palette(hooks: Sequence[str]) -> dict[str, str]:
    """A colour per method, in the order given (the report's order of first appearance)."""
    return {hook: COLOURS[i % len(COLOURS)] for i, hook in enumerate(dict.fromkeys(hooks))}


def curves_figure(group: Group, colours: dict[str, str]) -> str:
    """The group's evaluation metric and training loss, each against step, training time and wire
    bytes: six charts in one SVG."""
    assert group.metric is not None
    metric = group.metric
    figure, axes = pyplot.subplots(2, 3, figsize=(13.5, 7.0), constrained_layout=True)
    rows = (
        ("eval", metric.name, f"eval {metric.name}" + (" (%)" if metric.percent else "")),
        ("train", "loss", "train loss"),
    )
    for row, (kind, key, ylabel) in zip(axes, rows, strict=True):
        scale = 100.0 if kind == "eval" and metric.percent else 1.0
        starts: list[float] = []
        for ax, (x, xlabel, xscale) in zip(row, X_AXES, strict=True):
            for method in group.methods:
                line = curve(method.finished, kind, key, x)
                if line is None:
                    continue
                starts.append(line.mean[0] * scale)
                xs = [v * xscale for v in line.x]
                colour = colours[method.hook]
                ax.plot(xs, [v * scale for v in line.mean], color=colour, linewidth=1.6, label=method.name,
                        linestyle="--" if is_torch_spec(method.hook) else "-")  # fmt: skip
                if len(method.finished) > 1:
                    ax.fill_between(xs, [v * scale for v in line.low], [v * scale for v in line.high], color=colour,
                                    alpha=0.15, linewidth=0)  # fmt: skip
            if kind == "eval" and group.target is not None:
                ax.axhline(group.target * scale, color="black", linewidth=0.8, linestyle=":", label="target")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if kind == "train" and starts:  # a diverging method leaves the chart instead of flattening the rest
                ax.set_ylim(0, 1.2 * max(starts))
    handles, labels = axes[0][0].get_legend_handles_labels()
    # as many columns as the longest name leaves room for (local SGD's and DiLoCo's names are long)
    columns = max(1, min(len(labels), 4, LEGEND_CHARACTERS // (max(map(len, labels), default=1) + 8)))
    figure.legend(handles, labels, loc="outside lower center", ncol=columns, frameon=False)
    return svg(figure)


LEGEND_CHARACTERS = 170
"""About how many characters of the legend's font fit across the curves' figure (13.5 inches)."""


def time_to_target_figure(group: Group, colours: dict[str, str]) -> str:
    """Each method's time to target (of the mean over seeds; a tick per seed that reached it on its
    own), fastest first; methods that never reached it are in the table, not drawn."""
    reached = sorted((m for m in group.methods if m.time_to_target is not None), key=lambda m: m.time_to_target or 0)
    figure, ax = pyplot.subplots(figsize=(7.5, 0.45 * max(len(reached), 1) + 1.1), constrained_layout=True)
    for i, method in enumerate(reached):
        ax.barh(i, method.time_to_target or 0.0, color=colours[method.hook], alpha=0.85,
                hatch="//" if is_torch_spec(method.hook) else None)  # fmt: skip
        seeds = [t for t in method.times_to_target if t is not None]
        ax.plot(seeds, [i] * len(seeds), "|", color="black", markersize=12)
    ax.set_yticks(range(len(reached)), [m.name for m in reached])
    ax.invert_yaxis()
    ax.set_xlabel("training time to target (s): of the mean over seeds; a tick per seed")
    ax.grid(axis="x", alpha=0.3)
    return svg(figure)


def svg(figure: Any) -> str:
    """``figure`` as an SVG element for inline use (no XML header, doctype or metadata), then closed."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    pyplot.close(figure)
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    return re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text, count=2)  # inline SVG in HTML needs no namespaces


pyplot.rcParams.update({"svg.fonttype": "none", "font.family": "sans-serif", "font.size": 9, "svg.hashsalt": "gc"})
"""Text stays text (the browser's own sans-serif: nothing embedded or fetched); ids are reproducible."""
