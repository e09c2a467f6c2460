"""The command line of ``gradcomp bench ddp`` and ``gradcomp bench fsdp`` (the same options, each
mode's defaults): the arguments become :class:`BenchSettings`, measured once per network, and the
tables go to stdout (``--json``: every figure and the machine, to a file)."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from gradcomp.experiments.bench import runner
from gradcomp.experiments.bench.modes import DDP, Mode
from gradcomp.experiments.bench.settings import BenchSettings
from gradcomp.experiments.bench.table import format_run
from gradcomp.experiments.bench.workloads import PRESETS, UserModel, import_from_current_directory, user_model
from gradcomp.hooks.torch_hooks import PREFIX, is_torch_spec
from gradcomp.options import split_list


def split_hooks(text: str) -> list[str]:
    """``"fp16,topk:ratio=0.01,ef=true;powersgd"`` -> three specs (:func:`gradcomp.options.split_list`)."""
    return split_list(text)


def add_parser(commands: argparse._SubParsersAction, mode: Mode, help: str) -> None:
    """The command of ``mode`` (``gradcomp bench ddp`` or ``gradcomp bench fsdp``): the same options."""
    from gradcomp.cli import NET_HELP

    parser = commands.add_parser(mode.name, help=help)
    parser.add_argument(
        "--model",
        default="mlp",
        help=f"model preset ({', '.join(sorted(PRESETS))}; default mlp) or your own as pkg.module:factory "
        "(a function returning the nn.Module, importable from the current directory or PYTHONPATH)",
    )
    parser.add_argument(
        "--input-shape", help="with pkg.module:factory: one sample's input shape, e.g. 3,32,32 (random inputs)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="with pkg.module:factory: samples per rank (default 8)"
    )
    parser.add_argument(
        "--input-high", type=int, help="with pkg.module:factory: integer inputs below this (token ids), not floats"
    )
    parser.add_argument("--ranks", type=int, default=2, help="processes to start on this machine (default 2)")
    parser.add_argument("--net", default="loopback", help=NET_HELP)
    parser.add_argument(
        "--hooks",
        default=mode.hooks,
        help="hook specs, gradcomp's or torch's (torch:bf16), separated by ';' (or ',' before a new name)",
    )
    parser.add_argument(
        "--torch-hooks",
        default=";".join(mode.torch_hooks),
        help=f"torch's own to measure besides its default ({mode.anchor}), separated as --hooks, "
        f"or none (default {';'.join(mode.torch_hooks)}; the torch: prefix may be left out)",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the timed steps are spread over (default 5)")
    parser.add_argument(
        "--runs", type=int, default=1, help="independent runs (fresh ranks each); figures are medians over them"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--device", default="cpu", help="where ranks compute: cpu, or cuda (rank r on GPU r mod the GPUs; default cpu)"
    )
    parser.add_argument(
        "--backend", default="gloo", help="the process group's backend: gloo, or nccl with --device cuda (default gloo)"
    )
    parser.add_argument(
        "--accelerator-paths",
        action="store_true",
        help="on the CPU, take the paths GPU tensors take (decided on the device, no host reads): their cost here",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write every figure and the machine to FILE")
    parser.set_defaults(run=functools.partial(_command, mode=mode))


def settings_of(args: argparse.Namespace, mode: Mode, network: str) -> BenchSettings:
    """The command's arguments as :class:`BenchSettings` on ``network`` (a bad one fails here)."""
    named = [] if args.torch_hooks.strip() == "none" else split_hooks(args.torch_hooks)
    torch_hooks = tuple(h if is_torch_spec(h) else PREFIX + h for h in named)
    model: str | UserModel = args.model
    if args.model not in PRESETS:
        import_from_current_directory()
        model = user_model(args.model, args.input_shape, args.batch_size, args.input_high)
    return BenchSettings(
        model, args.ranks, network, tuple(split_hooks(args.hooks)), torch_hooks, steps=args.steps,
        warmup=args.warmup, rounds=args.rounds, seed=args.seed, threads=args.threads, runs=args.runs, mode=mode,
        device=args.device, backend=args.backend, accelerator_paths=args.accelerator_paths,
    )  # fmt: skip


def _command(args: argparse.Namespace, mode: Mode = DDP) -> int:
    from gradcomp.bench.report import machine, write_report
    from gradcomp.netem import check, parse_profiles

    networks = parse_profiles(args.net)
    settings = settings_of(args, mode, networks[0])
    for network in networks:
        check(network, settings.ranks)  # a network this machine cannot build fails before any rank starts
    import torch

    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device (make gpu-check runs where one is)")
    if settings.backend == "nccl" and torch.cuda.device_count() < settings.ranks:
        gpus = torch.cuda.device_count()
        raise ValueError(f"--backend nccl needs a GPU per rank: {settings.ranks} ranks, {gpus} GPUs")
    from gradcomp.progress import Progress

    host, rows = machine(), []
    with Progress(f"bench {mode.name}", runner.units(settings) * len(networks)) as progress:
        for network in networks:
            on_network = dataclasses.replace(settings, network=network)
            measured = runner.run(on_network, progress)
            progress.write(format_run(on_network, measured, host))
            rows += measured
    if args.json:
        figures = {"model": args.model, "ranks": args.ranks, "networks": networks, "parallel": mode.name}
        write_report(args.json, host, **figures, rows=[dataclasses.asdict(r) for r in rows])
    return 0
