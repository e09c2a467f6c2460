"""``gradcomp plan --html``: the plan as one HTML page in the report's style (inline SVG, no script)."""

from __future__ import annotations

import html
from typing import Any

from gradcomp.experiments.report import plots
from gradcomp.experiments.report.page import STYLE
from gradcomp.experiments.report.plots import pyplot
from gradcomp.hooks.torch_hooks import is_torch_spec


def render(figures: dict[str, Any]) -> str:
    """The page of :func:`gradcomp.experiments.plan.command._figures`' output."""
    colours = plots.palette(list(figures["scaling"]))
    options = sorted(figures["options"], key=lambda o: o["step_s"])
    rows = "".join(_row(o) for o in options)
    recommendation = figures["recommendation"]
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gradcomp plan: {figures['ranks']} ranks</title><style>{STYLE}</style></head><body>",
        f"<h1>gradcomp plan: {_e(figures['model'])} on {figures['ranks']} ranks</h1>",
        f'<p class="note">Link between nodes: {_e(figures["link"])}; kernels: {_e(figures["kernels"])}. '
        f"Command: <code>{_e(figures['command'])}</code></p>",
        f'<p class="verdict">{_e(recommendation["reason"])}</p>',
        '<p class="note">Predicted step times, not accuracy: a lossy compressor may need more steps to reach the '
        "same accuracy (the time-to-accuracy study, docs/results.md, measures that).</p>",
        "<h2>Every method and route</h2>",
        '<div class="scroll"><table><tr><th class="name">method</th><th class="name">route</th>'
        '<th class="name">hook runs it</th><th>ms/step</th><th>compute ms</th><th>compress ms</th>'
        "<th>decompress ms</th><th>collectives ms</th><th>exposed ms</th><th>MB sent per rank</th></tr>"
        f"{rows}</table></div>",
        f"<figure>{_options_figure(options, colours)}</figure>",
        "<h2>Scaling</h2>",
        '<p class="note">Each method over its fastest route a hook runs, at every world size.</p>',
        f"<figure>{_scaling_figure(figures['scaling'], colours)}</figure>",
        *(f'<p class="note">{_e(note)}</p>' for note in figures.get("scaling_notes", [])),
        "</body></html>",
    ]) + "\n"  # fmt: skip


def _row(option: dict[str, Any]) -> str:
    names = (option["name"], option["route"], "yes" if option["available"] else "predicted only")
    figures = [f"{option[key] * 1e3:.1f}" for key in ("step_s", "compute_s", "compress_s", "decompress_s",
                                                        "communicate_s", "exposed_s")]  # fmt: skip
    cells = [f"<td class='name'>{_e(n)}</td>" for n in names] + [f"<td>{f}</td>" for f in figures]
    return f"<tr>{''.join(cells)}<td>{option['sent_bytes'] / 1e6:.2f}</td></tr>"


def _options_figure(options: list[dict[str, Any]], colours: dict[str, str]) -> str:
    figure, ax = pyplot.subplots(figsize=(11.0, 0.3 * len(options) + 1.2), constrained_layout=True)
    for i, o in enumerate(options):
        ax.barh(i, o["step_s"] * 1e3, color=colours.get(o["method"], "#7f7f7f"), alpha=0.85,
                hatch=None if o["available"] else "//")  # fmt: skip
        ax.barh(i, o["compute_s"] * 1e3, color="black", alpha=0.15)
    ax.set_yticks(range(len(options)), [f"{o['name']} [{o['route']}]" for o in options])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("predicted ms per step, log scale (grey: compute; hatched: predicted only, no hook runs it)")
    ax.grid(axis="x", alpha=0.3)
    return plots.svg(figure)


def _scaling_figure(scaling: dict[str, list[dict[str, Any]]], colours: dict[str, str]) -> str:
    figure, (steps, shares) = pyplot.subplots(1, 2, figsize=(12.5, 4.6), constrained_layout=True)
    for label, curve in scaling.items():
        if not curve:
            continue
        ranks = [c["ranks"] for c in curve]
        style = {"color": colours[label], "linestyle": "--" if is_torch_spec(label) else "-", "marker": "o",
                 "markersize": 3, "label": curve[0]["name"]}  # fmt: skip
        steps.plot(ranks, [c["step_s"] * 1e3 for c in curve], **style)
        shares.plot(ranks, [100 * c["communication_share"] for c in curve], **style)
    for ax, label in ((steps, "predicted ms per step"), (shares, "% of the step beyond compute")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    steps.set_yscale("log")
    handles, labels = steps.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), frameon=False)
    return plots.svg(figure)


def _e(text: object) -> str:
    return html.escape(str(text))
