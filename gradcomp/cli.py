"""The ``gradcomp`` command.

gradcomp compressors                       list compressors and their options
gradcomp bench compressors [--sizes ...]   time every compressor against the memory floor
gradcomp bench collectives [--ranks ...]   all-reduce bus bandwidth per algorithm, beside gloo's
gradcomp calibrate --net N -o FILE         fit the link and the kernels' costs into a profile (JSON)
gradcomp netem cleanup|list                namespaces of emulated networks (``--net`` elsewhere)

The layers above the core add their own commands (``gradcomp bench ddp``, ``gradcomp sweep``) through
the entry-point groups ``gradcomp.commands`` and ``gradcomp.bench``: each entry is a function that takes
the argparse sub-parsers and adds one parser whose ``run`` default runs it. That keeps the dependencies
pointing one way (``experiments`` -> ``gradcomp``) while one ``gradcomp`` command offers everything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version

# Only what the command line needs: torch and the compressors load inside the commands that use them,
# so that `gradcomp --help` answers in a fraction of torch's import time (tests/test_cli.py).
from gradcomp import __version__, netem
from gradcomp.bench.units import ACCEPTED, parse_sizes
from gradcomp.launch import RankError
from gradcomp.netem import NetemError
from gradcomp.options import split_list
from gradcomp.progress import Progress


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = command_parser(words)
    args = parser.parse_args(words)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.run(args))
    except (ValueError, NetemError) as error:
        parser.exit(2, f"gradcomp: error: {error}\n")
    except RankError as error:  # ranks started here: a user's error on every rank in one line, once
        details = "" if error.user_error else f"{error.report}\n"
        parser.exit(2 if error.user_error else 1, f"gradcomp: error: {error.summary}\n{details}")
    except ImportError as error:  # a command of an extra that is not installed: one line, no traceback
        parser.exit(2, f"gradcomp: error: {_missing(error, _extras(args))}\n")
    except BrokenPipeError:  # the reader left (`gradcomp compressors | head`): not an error
        sys.stderr.close()
        return 0


def command_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``gradcomp`` command line, with the commands the installed layers add.

    With ``argv`` (the words it will parse), a layer's command that ``argv`` does not run is listed
    without being imported, so that ``gradcomp --help`` or ``gradcomp compressors`` pays for neither
    torch nor the experiments' imports; without it, every command is loaded (as documentation checks
    need)."""
    parser = argparse.ArgumentParser(prog="gradcomp", description="Gradient compression for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    parser.add_argument("--version", action="version", version=f"gradcomp {__version__} (torch {_torch_version()})")
    commands = parser.add_subparsers(dest="command", required=True)
    named = _named(argv)

    listing = commands.add_parser("compressors", help="list the registered compressors and their options")
    listing.set_defaults(run=_list_compressors)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    kernels = bench.add_parser("compressors", help="compress + decompress time against one fp16 cast")
    kernels.add_argument("--sizes", default="1M,25M", help=f"comma-separated tensor sizes: {SIZES_HELP}")
    kernels.add_argument("--specs", default=None, help="semicolon-separated compressor specs (default: all)")
    kernels.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    kernels.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the median is kept")
    kernels.add_argument("--seed", type=int, default=0)
    kernels.add_argument("--device", default="cpu", help="where the tensors live (cpu, cuda)")
    kernels.add_argument("--json", metavar="FILE", help="also write every figure and the machine to FILE")
    kernels.set_defaults(run=_bench_compressors)

    links = bench.add_parser("collectives", help="all-reduce bus bandwidth per algorithm, beside the backend's")
    links.add_argument("--ranks", type=int, default=2, help="processes to start on this machine (default 2)")
    links.add_argument(
        "--sizes", default="4KiB,64KiB,1MiB,4MiB,16MiB", help=f"comma-separated tensor sizes: {SIZES_HELP}"
    )
    links.add_argument(
        "--algos", default=None, help="comma-separated all-reduce algorithms (default: every one, native first)"
    )
    links.add_argument("--local-size", type=int, default=None, help="ranks per group for hierarchical (default 2)")
    links.add_argument("--repeats", type=int, default=10, help="timed runs per figure; the median is kept")
    links.add_argument("--net", default="loopback", help=NET_HELP)
    links.add_argument("--json", metavar="FILE", help="also write every figure and the machine to FILE")
    links.set_defaults(run=_bench_collectives)

    calibrate = commands.add_parser("calibrate", help="fit this link's latency and bandwidth and the kernels' costs")
    calibrate.add_argument("--net", default="loopback", help="one network profile: loopback (default), 1gbit, ...")
    calibrate.add_argument("--ranks", type=int, default=2, help="processes to start on this machine (default 2)")
    calibrate.add_argument("-o", "--output", required=True, metavar="PROFILE", help="where to write the profile (JSON)")
    calibrate.add_argument("--name", help="the profile's name (default NET-PRANKS)")
    calibrate.add_argument(
        "--sizes", default="4KiB,32KiB,256KiB,1MiB,4MiB,16MiB", help=f"collective sizes per rank: {SIZES_HELP}"
    )
    calibrate.add_argument("--repeats", type=int, default=10, help="timed collectives per size; the median is kept")
    calibrate.add_argument(
        "--specs", default=None, help="semicolon-separated compressor specs (default: the usual ones)"
    )
    calibrate.add_argument(
        "--device", default="cpu", help="where the kernels are timed: cpu (default) or cuda (a GPU per rank)"
    )
    calibrate.set_defaults(run=_calibrate)

    network = commands.add_parser("netem", help="emulated networks (network namespaces shaped with tc)")
    network_commands = network.add_subparsers(dest="netem", required=True)
    cleanup = network_commands.add_parser("cleanup", help="remove namespaces left by gradcomp processes that died")
    cleanup.add_argument("--all", action="store_true", help="remove every gradcomp namespace, even of live processes")
    cleanup.set_defaults(run=_netem_cleanup)
    listing = network_commands.add_parser("list", help="list gradcomp's namespaces on this machine")
    listing.set_defaults(run=_netem_list)
    _add_plugins(commands, "gradcomp.commands", None if named is None else named[:1])
    _add_plugins(bench, "gradcomp.bench", None if named is None else named[1:2] if named[:1] == ["bench"] else [])
    return parser


SIZES_HELP = f"{ACCEPTED}; elements are float32 (default %(default)s)"

NET_HELP = (
    "comma-separated network profiles: loopback (default), a rate (100mbit, 1gbit, 10gbit), rate-delay "
    "(1gbit-2ms) or rate=...,delay=...,jitter=...; emulated ones need root (gradcomp.netem)"
)


def summaries(group: str) -> dict[str, str]:
    """What the layers above the core say of their commands in ``group`` without being imported: the
    tables their ``gradcomp.summaries`` entry points name (``{group: {command: help}}``), merged. A
    command none describes is imported to be listed."""
    found: dict[str, str] = {}
    for entry in entry_points(group="gradcomp.summaries"):
        with contextlib.suppress(ImportError, AttributeError):  # a broken table: its commands load instead
            found.update(entry.load().get(group, {}))
    return found


CORE_EXTRAS = {"calibrate": "calibrate"}
"""The core's commands that need an extra (pyproject.toml): calibration fits its costs with scipy."""


def _named(argv: Sequence[str] | None) -> list[str] | None:
    """The command words of ``argv`` (``["bench", "ddp"]``): its words before the first option that
    follows a command. None when every command must be loaded."""
    if argv is None:
        return None
    words: list[str] = []
    for word in argv:
        if word.startswith("-"):
            if words:
                break
            continue  # the options before the command (-v, --version, --help) take no value
        words.append(word)
    return words


def _add_plugins(commands: argparse._SubParsersAction, group: str, wanted: Sequence[str] | None) -> None:
    """Add the commands the installed layers above the core (``experiments``) give to ``group``: those
    in ``wanted`` (all when None) loaded, the others listed by their summary. A layer whose extra is
    not installed still lists its commands; running one says in one line what to install."""
    described = summaries(group)
    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        if wanted is not None and entry.name not in wanted and entry.name in described:
            commands.add_parser(entry.name, help=described[entry.name])
            continue
        try:
            add_command = entry.load()
        except ImportError as error:
            # Its words, options included (no prefix character matches them), lead to the one line.
            unavailable = commands.add_parser(
                entry.name, help=described.get(entry.name, "(not installed)"), prefix_chars="\0", add_help=False
            )
            unavailable.add_argument("words", nargs="*", help=argparse.SUPPRESS)
            unavailable.set_defaults(run=_unavailable(_missing(error, entry.extras)))
            continue
        add_command(commands)


def _unavailable(message: str) -> typing.Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise ValueError(message)

    return run


def _extras(args: argparse.Namespace) -> list[str]:
    """The extras of the entry point that gave ``args``' command, or of a core command that needs one."""
    if args.command in CORE_EXTRAS:
        return [CORE_EXTRAS[args.command]]
    group, name = ("gradcomp.bench", args.bench) if args.command == "bench" else ("gradcomp.commands", args.command)
    return next((list(e.extras) for e in entry_points(group=group) if e.name == name), [])


def _missing(error: ImportError, extras: Sequence[str]) -> str:
    """One line: the module a command lacks and the extra that brings it. Re-raises ``error`` where
    no third-party module is missing (gradcomp's own import failing is a defect: its traceback)."""
    missing = error if isinstance(error, ModuleNotFoundError) else error.__cause__
    module = (getattr(missing, "name", None) or "gradcomp").partition(".")[0]
    if not isinstance(missing, ModuleNotFoundError) or module == "gradcomp":
        raise error
    if missing is not error:  # gradcomp's own message, which names the extra
        return str(error)
    install = f"pip install 'gradcomp[{','.join(extras)}]'" if extras else f"pip install {module}"
    return f"this command needs {module}, which is not installed: {install}"


def _torch_version() -> str:
    """torch's version from its metadata: importing torch for it would cost seconds."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _list_compressors(args: argparse.Namespace) -> int:
    from gradcomp.compressors import listing
    from gradcomp.engine import spec

    spec.load_other_kinds()  # the installed layers' kinds (auto, torch:...), imported to be listed
    sys.stdout.write(listing.text(spec.hook_names(), spec.option_lines(), spec.SHARDED_NAMES))
    return 0


def _bench_compressors(args: argparse.Namespace) -> int:
    import torch

    from gradcomp.bench import compressors as bench
    from gradcomp.bench import launches
    from gradcomp.bench.report import machine, write_report
    from gradcomp.bench.units import format_elements
    from gradcomp.compressors import fusion

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    sizes = [size.as_elements() for size in parse_sizes(args.sizes)]
    specs = split_list(args.specs) if args.specs else list(bench.DEFAULT_SPECS)
    with Progress("bench compressors", len(sizes) * (len(specs) + 1)) as progress:  # stderr, on a terminal only
        references, rows = bench.run(sizes, specs, args.repeats, args.seed, args.device, progress)
    host = machine()
    fused = fusion.enabled(torch.device(args.device))
    sys.stdout.write(
        f"gradcomp bench compressors: {host['cpu']}, torch {host['torch']}, {host['threads']} thread(s), "
        f"median of {args.repeats}, kernels {'fused by torch.compile' if fused else 'eager'} "
        f"({fusion.ENVIRONMENT}={fusion.setting()})\n\n"
    )
    sys.stdout.write(bench.format_table(references, rows) + "\n")
    counted = launches.rows(specs, seed=args.seed)
    sys.stdout.write(
        f"### Operators per bucket of {format_elements(counted[0][1].numel)} elements, compress + decompress\n\n"
        "On an accelerator's paths, each a kernel launch (4-10 us on a GPU): a bucket of one tensor, and one "
        f"of {counted[0][2].tensors} GPT-shaped tensors holding as many elements (gradcomp.bench.launches); "
        "the eager operators, which a fused kernel replaces by one or two.\n\n"
        + launches.format_table(counted) + "\n"
    )  # fmt: skip
    if args.json:
        kernels = [r.as_dict() for r in rows]
        operators = [{"spec": s, "one": dataclasses.asdict(a), "many": dataclasses.asdict(b)} for s, a, b in counted]
        write_report(args.json, host, references=[dataclasses.asdict(r) for r in references], rows=kernels,
                     launches=operators, fused=fused)  # fmt: skip
    return 0


def _bench_collectives(args: argparse.Namespace) -> int:
    from gradcomp import collectives
    from gradcomp.bench import collectives as bench
    from gradcomp.bench.report import machine, write_report

    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    sizes = [size.as_bytes() for size in parse_sizes(args.sizes)]
    algos = split_list(args.algos) if args.algos else list(collectives.ALGORITHMS)
    networks = netem.parse_profiles(args.net)
    for network in networks:
        netem.check(network, args.ranks)  # a network this machine cannot build fails before any rank starts
    local_size = args.local_size or (2 if args.ranks % 2 == 0 else 1)
    host = machine()
    rows = []
    with Progress("bench collectives", len(networks) * len(sizes)) as progress:  # stderr, on a terminal only
        for network in networks:
            measured = bench.run(args.ranks, sizes, algos, args.repeats, args.local_size, network, progress)
            link = netem.describe(netem.parse(network))
            table = bench.format_table(measured, local_size if "hierarchical" in algos else None)
            progress.write(
                f"gradcomp bench collectives: {args.ranks} ranks, network {network} ({link}), "
                f"gloo, {host['cpu']}, torch {host['torch']}, median of {args.repeats}\n\n{table}\n\n"
            )
            rows += measured
    if args.json:
        write_report(args.json, host, ranks=args.ranks, networks=networks, rows=[r.as_dict() for r in rows])
    return 0


def check_writable(path: str) -> None:
    """Refuse an output file that could not be written: its directory missing or not writable."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {path}: no directory {directory}")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot write {path}: not writable")


def _calibrate(args: argparse.Namespace) -> int:
    import scipy.stats  # noqa: F401  # the fit needs it: without the extra, refuse before minutes of measurements

    from gradcomp.cost import calibrate

    profiles = netem.parse_profiles(args.net)
    if len(profiles) != 1:
        raise ValueError(f"calibrate takes one network profile at a time, got {profiles}")
    netem.check(profiles[0], args.ranks)
    sizes = [size.as_bytes() for size in parse_sizes(args.sizes)]
    specs = [s.strip() for s in args.specs.split(";") if s.strip()] if args.specs else list(calibrate.KERNEL_SPECS)
    check_writable(args.output)  # before minutes of measurements that would have nowhere to go
    with Progress("calibrate", calibrate.units(specs)) as progress:  # stderr, on a terminal only
        profile = calibrate.calibrate(profiles[0], args.ranks, name=args.name, sizes=sizes, repeats=args.repeats,
                                      specs=specs, device=args.device, progress=progress)  # fmt: skip
    profile.save(args.output)
    sys.stdout.write(f"{calibrate.describe(profile)}\nwritten to {args.output}\n")
    return 0


def _netem_cleanup(args: argparse.Namespace) -> int:
    removed = netem.cleanup(all_=args.all)
    sys.stdout.write("".join(f"removed {name}\n" for name in removed) or "nothing to remove\n")
    return 0


def _netem_list(args: argparse.Namespace) -> int:
    stale = set(netem.leftovers())
    for name in netem.namespaces():
        sys.stdout.write(f"{name}{'  (stale: its process is gone)' if name in stale else ''}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
