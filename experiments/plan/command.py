"""``gradcomp plan``: which compressor and algorithm to use on a cluster, before renting it.

::

    gradcomp plan --params 25M --compute-ms 150 --ranks 1024 --nodes 128x8 --net 25gbit --intra 600GB/s
    gradcomp plan --model cnn --ranks 64 --net 10gbit --calibration 1gbit.json --html plan.html

The model is ``--params N`` (layers of 2048 x 2048 and a remainder, their gradients ready evenly over
backward; ``--compute-ms`` is then required), a preset of ``gradcomp bench ddp`` (``mlp``, ``cnn``,
``transformer``: its compute timed here unless ``--compute-ms`` is given), or your own
``pkg.module:factory`` (its parameters' shapes; ``--compute-ms`` required). The link between nodes is
``--net`` (a rate, with ``--latency``) or, without it, the one a calibration profile fitted; the
compressors' kernel costs come from ``--calibration`` (``gradcomp calibrate``) or are timed on this
machine now, or for ``--device h100`` (``h200``, ``a100``, ``l4``) are estimated by a roofline from
the bytes their kernels move (:mod:`gradcomp.cost.roofline`). The output says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from gradcomp.bench.report import markdown_table
from gradcomp.bench.units import parse_bandwidth, parse_duration, parse_size
from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.cost import plan
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import KernelTable
from gradcomp.cost.profile import INSIDE, Profile
from gradcomp.cost.roofline import DEVICES, RooflineTable
from gradcomp.cost.step import Method, Workload, method_of
from gradcomp.experiments.report.analysis import short_name
from gradcomp.hooks.torch_hooks import TorchHookSpec, is_torch_spec
from gradcomp.options import parse_naming

LAYER = 2048
"""``--params N`` is priced as layers of LAYER x LAYER (and a remainder)."""
MAX_RANKS = 1 << 20
DEFAULT_LATENCY = "20us"
"""One-way latency between nodes when ``--net`` gives none (a TCP message inside a data centre)."""
DEFAULT_INTRA_LATENCY = "2us"
DEFAULT_TORCH_HOOKS = ("torch:allreduce", "torch:fp16")


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything a plan is computed from, and where each part came from (for the output)."""

    workload: Workload
    model: str
    ranks: int
    local_size: int
    inter: LinkCosts
    intra: LinkCosts | None
    link_source: str
    kernels: KernelTable | RooflineTable
    kernel_source: str
    gather: LinkCosts | None = None
    kernel_kind: str = "timed"
    device: str = "cpu"
    """``calibrated`` (a profile's), ``timed`` (here, now) or ``estimate`` (a roofline: ``--device``)."""
    shared_uplink: bool = False
    """``--nic node``: the link between nodes is one uplink per node, which its ranks share."""

    def cluster(self, ranks: int | None = None) -> Cluster:
        """The cluster at ``ranks`` (default: the one asked about): nodes of ``local_size`` ranks,
        or one node when there are fewer ranks than that."""
        p = ranks or self.ranks
        local = min(self.local_size, p)
        if p % local:
            raise ValueError(f"{p} ranks do not fill nodes of {local}")
        return Cluster(p, self.inter, local, self.intra, native_all_gather=self.gather,
                       shared_uplink=self.shared_uplink and local > 1)  # fmt: skip


def layers(numel: int) -> list[tuple[int, ...]]:
    """``numel`` parameters as LAYER x LAYER matrices, then what is left (rows of LAYER, then a vector)."""
    block = LAYER * LAYER
    shapes: list[tuple[int, ...]] = [(LAYER, LAYER)] * (numel // block)
    rest = numel % block
    if rest >= LAYER:
        shapes.append((rest // LAYER, LAYER))
    if rest % LAYER:
        shapes.append((rest % LAYER,))
    return shapes


def _workload(args: argparse.Namespace) -> tuple[Workload, str]:
    from gradcomp.experiments.bench import predict
    from gradcomp.experiments.bench.workloads import PRESETS

    compute_s = None if args.compute_ms is None else args.compute_ms / 1e3
    if compute_s is not None and not (math.isfinite(compute_s) and compute_s >= 0):
        raise ValueError(f"--compute-ms must be a finite number of milliseconds >= 0, got {args.compute_ms}")
    if (args.params is None) == (args.model is None):
        raise ValueError("give the model as --params N or --model PRESET_OR_IMPORT_PATH (one of them)")
    if args.params is not None:
        numel = parse_size(args.params).as_elements()
        if numel < 1:
            raise ValueError("--params must be at least 1")
        if compute_s is None:
            raise ValueError("--params needs --compute-ms (the model's forward + backward + optimizer per step)")
        return Workload.uniform(layers(numel), compute_s), f"{numel:,} parameters ({args.compute_ms:g} ms of compute)"
    if args.model in PRESETS:
        preset = PRESETS[args.model]
        measured = predict.workload_of(preset)
        if compute_s is None:
            return measured, f"{preset.about} (compute timed here: {measured.compute_s * 1e3:.1f} ms per step)"
        return predict.scaled(measured, compute_s), f"{preset.about} ({args.compute_ms:g} ms of compute)"
    module_name, colon, function = args.model.partition(":")
    if not colon:
        raise ValueError(f"--model takes a preset ({', '.join(PRESETS)}) or pkg.module:factory, got {args.model!r}")
    if compute_s is None:
        raise ValueError(f"--model {args.model} needs --compute-ms (its step's compute is not known here)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        model = getattr(importlib.import_module(module_name), function)()
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot build --model {args.model}: {error}") from error
    if not isinstance(model, nn.Module):
        raise ValueError(f"{args.model} returned a {type(model).__name__}, not a torch.nn.Module")
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    if not shapes:
        raise ValueError(f"{args.model} has no trainable parameters")
    count = sum(math.prod(s) for s in shapes)
    return Workload.uniform(
        shapes, compute_s
    ), f"{args.model}, {count:,} parameters ({args.compute_ms:g} ms of compute)"


def setting(args: argparse.Namespace) -> Setting:
    """Check every input (clear errors, before anything is timed) and build the :class:`Setting`."""
    if not 1 <= args.ranks <= MAX_RANKS:
        raise ValueError(f"--ranks must be in 1..{MAX_RANKS}, got {args.ranks}")
    local = 1
    if args.nodes:
        nodes, x, per_node = args.nodes.lower().partition("x")
        if not x or not nodes.isdigit() or not per_node.isdigit() or int(nodes) < 1 or int(per_node) < 1:
            raise ValueError(f"--nodes takes NODESxRANKS_PER_NODE (128x8), got {args.nodes!r}")
        if int(nodes) * int(per_node) != args.ranks:
            raise ValueError(f"--nodes {args.nodes} is {int(nodes) * int(per_node)} ranks, but --ranks is {args.ranks}")
        local = int(per_node)
    profile = Profile.load(args.calibration) if args.calibration else None
    gather = None
    if args.net:
        inter = LinkCosts(parse_duration(args.latency), 1 / parse_bandwidth(args.net))
        link_source = f"{args.net}, {args.latency} latency"
    elif profile is not None:
        inter = profile.link("all_reduce")
        gather = profile.links["all_gather"].costs if "all_gather" in profile.links else None
        link_source = f"calibrated: profile {profile.name} ({profile.network}, {1 / inter.beta / 1e9:.3f} GB/s)"
    else:
        raise ValueError("give the link between nodes as --net RATE (25gbit, 100mbit) or --calibration PROFILE")
    intra = None
    if args.intra:
        if local == 1:
            raise ValueError("--intra describes the link inside a node: give --nodes too")
        intra = LinkCosts(parse_duration(args.intra_latency), 1 / parse_bandwidth(args.intra))
    elif profile is not None and local > 1 and INSIDE + "all_reduce" in profile.links:
        intra = profile.link(INSIDE + "all_reduce")  # calibrated on an emulated cluster's nodes
    workload, model = _workload(args)
    kernels, kernel_source, kernel_kind = _kernels(args.device, profile, args.calibration)
    if args.nic == "node" and local == 1:
        raise ValueError("--nic node shares a node's uplink among its ranks: give --nodes too")
    if args.nic == "node":
        link_source += ", one uplink per node"
    return Setting(
        workload, model, args.ranks, local, inter, intra, link_source, kernels, kernel_source, gather, kernel_kind,
        args.device, args.nic == "node",
    )  # fmt: skip


def _kernels(device: str, profile: Profile | None, path: str | None) -> tuple[KernelTable | RooflineTable, str, str]:
    """The kernel costs for ``device``, where they come from, and their kind (``calibrated``,
    ``timed`` here now, or ``estimate``). For a GPU, a profile calibrated with ``--device cuda``
    gives them; else the roofline does."""
    if device == "cpu":
        if profile is not None:
            return KernelTable(profile.kernels), f"profile {profile.name} ({path})", "calibrated"
        return KernelTable(), "timed on this machine now", "timed"
    if device not in DEVICES:
        raise ValueError(f"--device must be cpu or one of {', '.join(DEVICES)}, got {device!r}")
    timed_on = profile.machine.get("kernel_device", "cpu") if profile is not None else "cpu"
    if profile is not None and timed_on != "cpu":
        return KernelTable(profile.kernels), f"profile {profile.name} ({path}), timed on {timed_on}", "calibrated"
    known = DEVICES[device]
    source = (
        f"estimated for {known.description} by a roofline ({known.bandwidth / 1e12:.2f} TB/s streamed, "
        f"{known.launch_s * 1e6:.0f} us per kernel) from the kernels each compressor launches and the bytes "
        "they move: an estimate until calibrated on the device"
    )
    if profile is not None:
        source += f" (profile {profile.name}'s kernels were timed on a CPU: not used)"
    return RooflineTable(known), source, "estimate"


def methods_of(candidates: Sequence[str], torch_hooks: Sequence[str]) -> list[Method]:
    """gradcomp's candidates and torch's hooks as cost-model methods (a bad spec is refused here)."""
    found = [parse_naming(c, method_of) for c in candidates]
    found += [parse_naming(t, TorchHookSpec.parse).cost_method() for t in torch_hooks]
    if any(m.spec.noop for m in found):
        raise ValueError("noop sends nothing, so its replicas drift apart: it is no candidate for averaging gradients")
    labels = [m.label for m in found]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a candidate is given twice: {labels}")
    return found


def _table(found: Sequence[plan.Option], baseline: plan.Option | None) -> str:
    rows = sorted(found, key=lambda o: o.step.step_s)
    versus = f"vs allreduce ({baseline.route})" if baseline else "vs allreduce"
    header = ("method", "route", "hook runs it", "ms/step", versus, "beyond compute", "MB sent/rank")
    lines = [
        (short_name(o.method.label), o.route, "yes" if o.available else "predicted only", f"{o.step.step_s * 1e3:.1f}",
         f"{baseline.step.step_s / o.step.step_s:.2f}x" if baseline else "-", f"{o.step.communication_share:.0%}",
         f"{o.step.sent_bytes / 1e6:.2f}")
        for o in rows
    ]  # fmt: skip
    return markdown_table(header, lines, right=[False, False, False, True, True, True, True])


def _scaling_table(curves: dict[str, list[tuple[int, plan.Option]]]) -> str:
    ranks = sorted({p for curve in curves.values() for p, _ in curve})
    header = ("method", *(str(p) for p in ranks))
    lines = []
    for label, curve in curves.items():
        at = {p: o for p, o in curve}
        lines.append((short_name(label), *(f"{at[p].step.step_s * 1e3:.0f}" if p in at else "-" for p in ranks)))
    return markdown_table(header, lines)


def _command(args: argparse.Namespace) -> int:
    from gradcomp.cli import check_writable

    for output in (args.json, args.html):
        if output:
            check_writable(output)  # before the table is computed (kernels timed here: seconds)
    chosen = setting(args)
    from gradcomp.experiments.bench.command import split_hooks

    given = split_hooks(args.candidates)
    candidates = [c for c in given if not is_torch_spec(c)]  # torch's among them priced as --torch-hooks are
    named = [] if args.torch_hooks.strip() == "none" else split_hooks(args.torch_hooks)
    torch_hooks = list(dict.fromkeys([*(h if is_torch_spec(h) else "torch:" + h for h in named),
                                      *(c for c in given if is_torch_spec(c))]))  # fmt: skip
    methods = methods_of(candidates, torch_hooks)
    torch_labels = [m.label for m in methods if is_torch_spec(m.label)]
    ranks = [p for p in plan.SCALING_RANKS if p % min(chosen.local_size, p) == 0]
    found, curves = _predict(chosen, methods, torch_labels, ranks, quiet=bool(args.json))
    baseline = plan.best(found, "allreduce")
    choice, reason = plan.recommend(found, name=short_name)
    notes = plan.scaling_notes(curves, chosen.local_size, short_name) if chosen.local_size > 1 else []
    said = "".join(f"{note}\n\n" for note in notes)
    nodes = f", {chosen.ranks // chosen.local_size} nodes of {chosen.local_size}" if chosen.local_size > 1 else ""
    intra = (f"; inside nodes {1 / chosen.intra.beta / 1e9:.1f} GB/s, {chosen.intra.alpha * 1e6:.1f} us"
             if chosen.intra else "")  # fmt: skip
    sys.stdout.write(
        f"gradcomp plan: {chosen.model}; {chosen.ranks} ranks{nodes}; link between nodes: {chosen.link_source}{intra}; "
        f"kernels: {chosen.kernel_source}\n\nRecommendation: {reason}\n\n{_table(found, baseline)}\n\n"
        f"Predicted ms per step from 2 to {ranks[-1]} ranks (each method over its fastest route a hook runs):\n\n"
        f"{_scaling_table(curves)}\n\n{said}These are step times, not accuracy: lossy compressors may need more steps "
        "to the same accuracy (the time-to-accuracy study: docs/results.md).\n"
    )
    if chosen.kernels.timed_here:
        sys.stdout.write(f"Kernels timed on this machine now: {', '.join(chosen.kernels.timed_here)}\n")
    figures = _figures(chosen, found, choice, reason, curves)
    figures["scaling_notes"] = notes
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1)
    if args.html:
        from gradcomp.experiments.plan.page import render

        with open(args.html, "w") as file:
            file.write(render(figures))
    return 0


def _predict(
    chosen: Setting, methods: Sequence[Method], torch_labels: Sequence[str], ranks: Sequence[int], quiet: bool
) -> tuple[list[plan.Option], dict[str, list[tuple[int, plan.Option]]]]:
    """Every option at the asked size and each method's best from 2 to ``ranks[-1]``, saying on a
    terminal's stderr what runs and how far (the kernels timed or estimated, one by one, then each
    world size); nothing where stderr is no terminal, or with ``quiet`` (``--json``)."""
    from gradcomp.progress import Progress

    specs = list(dict.fromkeys(["none", *(m.kernel_spec for m in methods if m.kernel_spec)]))
    doing = {"timed": "timing", "estimate": "estimating"}.get(chosen.kernel_kind, "reading")
    with Progress("plan", len(specs) + 1 + len(ranks), enabled=False if quiet else None) as progress:
        for number, spec in enumerate(specs, 1):
            with progress.step(f"{doing} kernels {number}/{len(specs)}: {spec}"):
                chosen.kernels(spec)
        with progress.step(f"predicting {len(methods)} methods on every route at {chosen.ranks} ranks"):
            found = plan.options(chosen.workload, chosen.cluster(), methods, chosen.kernels, torch_labels)
        curves: dict[str, list[tuple[int, plan.Option]]] = {m.label: [] for m in methods}
        for p in ranks:
            with progress.step(f"scaling: {p} ranks"):
                at = plan.scaling(chosen.workload, chosen.cluster, methods, chosen.kernels, [p], torch_labels)
            for label, curve in at.items():
                curves[label] += curve
    return found, curves


def _figures(
    chosen: Setting, found: Sequence[plan.Option], choice: plan.Option, reason: str,
    curves: dict[str, list[tuple[int, plan.Option]]],
) -> dict[str, Any]:  # fmt: skip
    def option(o: plan.Option) -> dict[str, Any]:
        return {"method": o.method.label, "name": short_name(o.method.label), "route": o.route,
                "available": o.available, **dataclasses.asdict(o.step), "exposed_s": o.step.exposed_s,
                "communication_share": o.step.communication_share}  # fmt: skip

    return {
        "command": " ".join(sys.argv),
        "model": chosen.model,
        "ranks": chosen.ranks,
        "local_size": chosen.local_size,
        "link": chosen.link_source,
        "inter": dataclasses.asdict(chosen.inter),
        "intra": dataclasses.asdict(chosen.intra) if chosen.intra else None,
        "kernels": chosen.kernel_source,
        "kernels_kind": chosen.kernel_kind,
        "device": chosen.device,
        "timed_here": list(chosen.kernels.timed_here),
        "options": [option(o) for o in found],
        "recommendation": {"method": choice.method.label, "route": choice.route, "reason": reason},
        "names": {m: short_name(m) for m in curves},
        "scaling": {label: [{"ranks": p, **option(o)} for p, o in curve] for label, curve in curves.items()},
    }


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp plan`` (an entry point of the ``gradcomp.commands`` group)."""
    parser = commands.add_parser("plan", help="predict every compressor and algorithm on a cluster; recommend one")
    parser.add_argument("--params", help="the model as N parameters (25M), with --compute-ms")
    parser.add_argument("--model", help="a preset (mlp, cnn, transformer, gpt) or pkg.module:factory")
    parser.add_argument(
        "--compute-ms", type=float, help="forward + backward + optimizer per step, without communication"
    )
    parser.add_argument("--ranks", type=int, required=True, help="data-parallel ranks")
    parser.add_argument("--nodes", help="NODESxRANKS_PER_NODE (128x8): ranks in a node share the --intra link")
    parser.add_argument("--net", help="the link between nodes, per rank: 25gbit, 100mbit, 12.5GB/s")
    parser.add_argument(
        "--latency", default=DEFAULT_LATENCY, help="one message's latency on --net (default %(default)s)"
    )
    parser.add_argument(
        "--nic", choices=("rank", "node"), default="rank",
        help="rank (default): --net is each rank's own path across nodes (a NIC per GPU); node: --net is one "
        "uplink per node, shared by its ranks (as the emulated clusters of --net nodes=...)",
    )  # fmt: skip
    parser.add_argument(
        "--intra",
        help="the link inside a node, per rank: 600GB/s (NVLink), 100gbit (default: a --calibration of an "
        "emulated cluster's, which fits it)",
    )
    parser.add_argument(
        "--intra-latency", default=DEFAULT_INTRA_LATENCY, help="latency inside a node (default %(default)s)"
    )
    parser.add_argument(
        "--calibration", metavar="PROFILE", help="a gradcomp calibrate profile: kernels (and the link without --net)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help=f"what computes: cpu (this machine's kernels, timed or from --calibration) or {', '.join(DEVICES)} "
        "(a roofline estimate from the bytes the kernels move); default %(default)s",
    )
    parser.add_argument(
        "--candidates", default=";".join(plan.CANDIDATES), help="hook specs, ';'-separated (torch's: torch:fp16)"
    )
    parser.add_argument(
        "--torch-hooks", default=";".join(DEFAULT_TORCH_HOOKS), help="torch's hooks to compare, or none"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every prediction to FILE")
    parser.add_argument("--html", metavar="FILE", help="also write a page with the scaling curves to FILE")
    parser.set_defaults(run=_command)
