"""``gradcomp sweep CONFIG``: the command (also ``python -m gradcomp.experiments.sweep CONFIG``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from gradcomp.experiments.report import records
from gradcomp.experiments.sweep import plan
from gradcomp.experiments.sweep.runner import Progress, existing, format_summary, lock, run_sweep
from gradcomp.experiments.training.config import method
from gradcomp.experiments.training.run import Terminated


def add_command(commands: argparse._SubParsersAction) -> None:
    """Add ``gradcomp sweep`` (an entry point of the group ``gradcomp.commands``)."""
    parser = commands.add_parser(
        "sweep",
        help="run a grid of trainings from a TOML config",
        description="Run every training of a sweep config, skipping finished runs (see docs/experiments.md).",
    )
    _add_arguments(parser)
    parser.set_defaults(run=_command)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        help=f"a sweep config (TOML file), or the name of one that ships with gradcomp: {', '.join(plan.shipped())}",
    )
    parser.add_argument("--out", help="directory of the runs (default: runs/<config name>)")
    parser.add_argument("--dry-run", action="store_true", help="check the config and list the runs; run nothing")
    parser.add_argument(
        "--skip-unavailable-networks",
        action="store_true",
        help="leave out the runs on emulated networks this machine cannot build (saying why), instead of refusing",
    )
    parser.add_argument("--no-report", action="store_true", help="do not write OUT/report.html at the end")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep finished runs' checkpoints (by default only unfinished runs keep theirs, to continue from)",
    )


def _command(args: argparse.Namespace) -> int:
    path = plan.find_config(args.config)
    out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(path))[0])
    skipped: dict[str, str] | None = {} if args.skip_unavailable_networks else None
    runs = plan.load(path, out, skipped)
    for network, reason in (skipped or {}).items():
        sys.stderr.write(f"sweep: leaving out the runs on {network}: {reason}\n")
    if args.dry_run:
        statuses = existing(runs)
        for run in runs:
            sys.stdout.write(f"{run.name}  {statuses[run.name] or 'not started'}\n")
        sys.stdout.write(f"{len(runs)} runs in {out}\n")
        return 0
    try:
        with lock(out):
            planned = [{"name": r.name, "label": r.label, "hook": method(r.config.to_dict()),
                        "network": r.config.network, "ranks": r.config.ranks, "seed": r.config.seed,
                        "parallel": r.config.parallel}
                       for r in runs]  # fmt: skip
            records.write_plan(out, os.path.abspath(path), planned)  # a report lists what is not made yet
            rows = run_sweep(runs, Progress(sys.stderr), keep_checkpoints=args.keep_checkpoints)
    except (KeyboardInterrupt, Terminated) as error:  # the run under way is recorded interrupted, its ranks ended
        how = f" by {signal.SIGTERM.name}" if isinstance(error, Terminated) else ""
        sys.stderr.write(f"\nsweep interrupted{how}: run the same command again to continue where it stopped\n")
        return 128 + (signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT)
    sys.stdout.write("\n" + format_summary(rows))
    with open(os.path.join(out, "summary.json"), "w") as file:
        json.dump({"config": os.path.abspath(path), "runs": [dataclasses.asdict(r) for r in rows]}, file, indent=2)
    if not args.no_report:
        sys.stdout.write(f"\nReport: {_report(out)}")
    sys.stdout.write(f"\nTensorBoard: tensorboard --logdir {out}\n")
    return 0 if all(r.status == "finished" for r in rows) else 1


def _report(out: str) -> str:
    """Write OUT/report.html (``gradcomp report OUT``); its path, or why it could not be written."""
    try:
        from gradcomp.experiments.report.command import write

        return write(out) + "\n"
    except (ImportError, ValueError) as error:
        return f"not written ({error})\n"


def command_parser() -> argparse.ArgumentParser:
    """``python -m gradcomp.experiments.sweep``'s command line."""
    parser = argparse.ArgumentParser(prog="python -m gradcomp.experiments.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    _add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradcomp.experiments.sweep CONFIG``: the same as ``gradcomp sweep``."""
    parser = command_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return _command(args)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
