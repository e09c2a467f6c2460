"""``gradcomp report RUNS_DIR [-o report.html] [--target-tolerance 0.5] [--baseline SPEC] [--metric NAME]``."""

from __future__ import annotations

import argparse
import os
import sys

from gradcomp import hooks
from gradcomp.experiments.training.config import OPTIMIZER_JOIN, method, split_method
from gradcomp.experiments.training.optim import parse_optimizer
from gradcomp.sync import SyncSpec


def add_command(commands: argparse._SubParsersAction) -> None:
    """Add ``gradcomp report`` (an entry point of the group ``gradcomp.commands``)."""
    parser = commands.add_parser(
        "report",
        help="an HTML page comparing a sweep's runs by time to accuracy",
        description="Write one self-contained HTML page (no script, no external URL) comparing the runs in "
        "RUNS_DIR: curves against step, training time and wire bytes, time to target, speedups over the "
        "baseline and over the fastest torch hook, and a verdict per group (see docs/report.md).",
    )
    parser.add_argument("runs_dir", metavar="RUNS_DIR", help="a sweep's output directory, or one run's")
    parser.add_argument("-o", "--output", help="the HTML file to write (default: RUNS_DIR/report.html)")
    parser.add_argument(
        "--target-tolerance",
        type=float,
        default=0.5,
        help="the target is the baseline's final metric less this: percentage points for accuracy, else "
        "percent of the baseline's value (default 0.5)",
    )
    parser.add_argument(
        "--baseline",
        help="the hook spec every group is measured against (default: the first it has of torch:allreduce, "
        "allreduce, torch:reduce_scatter, none)",
    )
    parser.add_argument(
        "--metric",
        help="the evaluation metric to compare by (loss, perplexity, accuracy; default: each task's headline); "
        "loss and perplexity count lower as better",
    )
    parser.add_argument("--markdown", metavar="FILE", help="also write the verdicts and tables as Markdown to FILE")
    parser.set_defaults(run=_command)


def _command(args: argparse.Namespace) -> int:
    path = write(args.runs_dir, args.output, args.target_tolerance, args.baseline, args.markdown, args.metric)
    sys.stdout.write(f"report: {path}\n" + (f"tables: {args.markdown}\n" if args.markdown else ""))
    return 0


def write(
    runs_dir: str,
    output: str | None = None,
    tolerance: float = 0.5,
    baseline: str | None = None,
    markdown: str | None = None,
    metric: str | None = None,
) -> str:
    """Analyse the runs in ``runs_dir``, write the page (default ``runs_dir/report.html``) and, if
    ``markdown`` names a file, the verdicts and tables as Markdown there; return the page's path."""
    from gradcomp.experiments.report import analysis, page, records

    if baseline is not None:
        baseline = _canonical(baseline)
    runs = records.load(runs_dir)
    groups = analysis.analyze(runs, tolerance, baseline, metric)
    path = output or os.path.join(runs_dir, "report.html")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        file.write(page.render(groups, runs, os.path.normpath(runs_dir), tolerance, baseline))
    if markdown:
        with open(markdown, "w") as file:
            file.write(page.markdown(groups, runs, tolerance))
    return path


def _canonical(hook: str) -> str:
    """A baseline's canonical text: a DDP hook spec, a sharded run's (``torch:reduce_scatter``), or
    local SGD's or DiLoCo's (``diloco:every=50 over allreduce``)."""
    sync, inner = split_method(hook)
    if sync is not None:
        return method({"sync": str(SyncSpec.parse(sync)), "hook": _canonical(inner)})
    optimizer, inner = split_method(hook, OPTIMIZER_JOIN)
    if optimizer is not None:
        return method({"optimizer": parse_optimizer(optimizer), "hook": _canonical(inner)})
    try:
        return str(hooks.parse(hook))
    except ValueError:
        return str(hooks.parse_sharded(hook))
