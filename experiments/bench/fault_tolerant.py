"""Fault-tolerant training's cost: gradcomp's compression on torchft against torchft's own, on
emulated links (the ``torchft`` extra; emulated networks need root and ``tc``).

    python -m gradcomp.experiments.bench.fault_tolerant --networks 1gbit,100mbit --model gpt

Two replica groups of one rank, each in its own network namespace behind the profile's link, under
a lighthouse of rank 0 (one per variant: a quorum never mixes variants); each variant is a torchft
``Manager`` of its own per group, trained in interleaved rounds (every variant a few steps, then the
next), a quorum at every step as torchft trains. Variants:

- ``torchft-ddp``: torchft's own DDP (its uncompressed all-reduce): the anchor;
- a gradcomp hook spec (``allreduce``, ``quantize:bits=4,ef=true``, ``auto``, ...): gradcomp's
  fault-tolerant DDP (``auto``'s decision printed below the table);
- ``torchft-diloco``: torchft's DiLoCo, synchronizing every ``--every`` inner steps uncompressed;
- ``diloco:<hook spec>``: gradcomp's DiLoCo on the manager, its outer gradients through the spec.

Per variant: the median step time (each step's slowest group), and the bytes a group put on its link
per step (its interface's transmit counter, read in its namespace: everything, quorum and heartbeats
included), as ratios against the anchor of their kind (DDP's, DiLoCo's). DiLoCo's per inner step:
a synchronization's cost spread over ``--every`` steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradcomp import netem
from gradcomp.experiments.bench.workloads import PRESETS
from gradcomp.launch import spawn

DDP_ANCHOR, DILOCO_ANCHOR = "torchft-ddp", "torchft-diloco"
DEFAULT_VARIANTS = (DDP_ANCHOR, "allreduce", "quantize:bits=4,ef=true", "topk:ratio=0.01,ef=true", DILOCO_ANCHOR,
                    "diloco:quantize:bits=4,ef=true")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "gpt"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    steps: int = 8
    """Timed steps per variant and round (DiLoCo: rounded up to whole synchronizations)."""
    rounds: int = 3
    every: int = 4
    """DiLoCo's inner steps per synchronization."""
    timeout: float = 120.0
    seed: int = 0


def _interface() -> str:
    """The interface the ranks talk on (``gradcomp.launch`` sets it: ``eth0`` in a namespace, else ``lo``)."""
    return os.environ.get("GLOO_SOCKET_IFNAME", "lo")


def _address(rank: int) -> str:
    """Rank ``rank``'s address on the emulated network (on loopback: this machine's)."""
    return netem.address_of(rank) if _interface() == netem.INTERFACE else "127.0.0.1"


def _lighthouses(rank: int, count: int) -> list[str]:
    """Rank 0 serves ``count`` lighthouses on its address; every rank gets their addresses."""
    from torchft.coordination import LighthouseServer

    servers = [LighthouseServer(bind="[::]:0", min_replicas=2) for _ in range(count)] if rank == 0 else []
    _SERVED[:] = servers  # alive as long as the rank
    box = [[f"http://{_address(0)}:{s.address().rsplit(':', 1)[1]}" for s in servers]]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])


_SERVED: list[Any] = []


class Variant:
    """One variant's model, optimizer and manager in this rank's replica group."""

    def __init__(self, name: str, rank: int, lighthouse: str, settings: Settings, index: int) -> None:
        import torchft
        import torchft.optim

        from gradcomp.experiments.replicas import one_rank_group
        from gradcomp.experiments.tasks import build_task

        self.name, self.diloco = name, name == DILOCO_ANCHOR or name.startswith("diloco:")
        task = build_task("synthetic")
        preset = PRESETS[settings.model]
        torch.manual_seed(settings.seed)
        self.model = task.build_model(preset.model)
        self.inputs, self.targets = task.batch(rank, preset.batch_size, settings.seed)
        self.manager = one_rank_group(f"{index}-{rank}", lighthouse, min_groups=2, timeout=settings.timeout,
                                      synchronous=self.diloco, address=_address(rank))  # fmt: skip
        inner = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.manager.register_state_dict_fn("model", self.model.load_state_dict, self.model.state_dict)
        self.outer: Any = None
        self.call_outer = False  # gradcomp's synchronizer is called after each inner step; torchft's hooks it
        if name == DDP_ANCHOR:
            import torchft.ddp

            self.trained: Any = torchft.ddp.DistributedDataParallel(self.manager, self.model)
            self.optimizer: Any = torchft.optim.OptimizerWrapper(self.manager, inner)
        elif self.diloco:
            self.trained, self.optimizer = self.model, inner
            if name == DILOCO_ANCHOR:
                from torchft.local_sgd import DiLoCo

                outer = torch.optim.SGD(self.model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                self.outer = DiLoCo(self.manager, [self.model], inner, outer, sync_every=settings.every)
                self.outer.__enter__()  # its optimizer hooks synchronize after inner.step()
            else:
                from gradcomp.sync import fault_tolerant as ft_sync

                spec = name.split(":", 1)[1]
                self.outer = ft_sync.DiLoCo(self.manager, self.model, inner, every=settings.every, spec=spec)
                self.call_outer = True
        else:
            from gradcomp.hooks import fault_tolerant as ft_hooks

            self.trained = ft_hooks.DistributedDataParallel(self.manager, self.model, name)
            self.optimizer = torchft.optim.OptimizerWrapper(self.manager, inner)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        output = self.trained(self.inputs)
        loss = torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), self.targets.reshape(-1))
        loss.backward()
        self.optimizer.step()
        if self.call_outer:
            self.outer.step()


def measure(rank: int, world: int, settings: Settings) -> dict[str, dict[str, Any]]:
    """Inside each rank: per variant, each timed step's seconds (the slowest group's), bytes sent, and
    what ``auto`` chose."""
    torch.set_num_threads(1)
    lighthouses = _lighthouses(rank, len(settings.variants))
    variants = [Variant(name, rank, lighthouses[i], settings, i) for i, name in enumerate(settings.variants)]
    seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    sent: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_ in range(settings.rounds + 1):  # round 0 warms up
        for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
            count = settings.steps
            if variant.diloco:  # whole synchronizations
                count = -(-count // settings.every) * settings.every
            dist.barrier()
            before, began = netem.sent_bytes(_interface()), time.perf_counter()
            steps = []
            for _ in range(count):
                start = time.perf_counter()
                variant.step()
                steps.append(time.perf_counter() - start)
            elapsed, bytes_ = time.perf_counter() - began, netem.sent_bytes(_interface()) - before
            if round_:
                seconds[variant.name] += [elapsed / count]
                sent[variant.name] += [bytes_ / count]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (seconds, sent))
    for variant in variants:
        variant.manager.shutdown(wait=False)
    slowest = {v: [max(r[0][v][i] for r in everyone) for i in range(len(seconds[v]))] for v in seconds}
    mean_sent = {v: [statistics.mean(r[1][v][i] for r in everyone) for i in range(len(sent[v]))] for v in sent}
    return {v.name: {"step_s": slowest[v.name], "sent_bytes": mean_sent[v.name], "chose": _chosen(v)} for v in variants}


def _chosen(variant: Variant) -> str | None:
    """What an ``auto`` variant's last decision put on the buckets (how many buckets each)."""
    decisions = getattr(getattr(variant.trained, "gradcomp_state", None), "decisions", None)
    if not decisions:
        return None
    counts = collections.Counter(decisions[-1]["buckets"])
    return ", ".join(f"{spec} ({n} of {len(decisions[-1]['buckets'])} buckets)" for spec, n in counts.items())


def run(settings: Settings, network: str) -> dict[str, Any]:
    """Both groups behind ``network``; per variant its figures and ratios to its anchor."""
    results = spawn(2, measure, (settings,), network=network, timeout=1800, group_timeout=settings.timeout)[0]
    table: dict[str, Any] = {}
    for name, figures in results.items():
        anchor = DILOCO_ANCHOR if name == DILOCO_ANCHOR or name.startswith("diloco:") else DDP_ANCHOR
        step = statistics.median(figures["step_s"])
        sent = statistics.median(figures["sent_bytes"])
        base = results.get(anchor)
        table[name] = {
            "step_ms": step * 1e3,
            "sent_mb": sent / 1e6,
            "step_vs_anchor": step / statistics.median(base["step_s"]) if base else None,
            "bytes_vs_anchor": sent / statistics.median(base["sent_bytes"]) if base else None,
            "rounds_ms": [s * 1e3 for s in figures["step_s"]],
            "chose": figures["chose"],
        }
    return table


def markdown(network: str, table: dict[str, Any]) -> str:
    rows = [f"{network}: | variant | step ms (rounds) | x anchor | MB sent per step | x anchor |",
            "|---|---|---|---|---|"]  # fmt: skip
    for name, r in table.items():
        rounds = ", ".join(f"{ms:.0f}" for ms in r["rounds_ms"])
        ratio = "-" if r["step_vs_anchor"] is None else f"{r['step_vs_anchor']:.2f}"
        sent = "-" if r["bytes_vs_anchor"] is None else f"{r['bytes_vs_anchor']:.3f}"
        rows.append(f"| `{name}` | {r['step_ms']:.0f} ({rounds}) | {ratio} | {r['sent_mb']:.2f} | {sent} |")
    chosen = [f"`{name}` chose {r['chose']}" for name, r in table.items() if r.get("chose")]
    return "\n".join(rows + (["", *chosen] if chosen else []))


def command_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(prog="gradcomp.experiments.bench.fault_tolerant",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--networks", default="1gbit,100mbit", help="netem profiles, comma-separated")
    parser.add_argument("--model", default="gpt", choices=sorted(PRESETS))
    parser.add_argument(
        "--variant",
        action="append",
        dest="variants",
        help=f"a variant (repeat the option for several; default: {', '.join(DEFAULT_VARIANTS)})",
    )
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--every", type=int, default=Settings.every)
    parser.add_argument("--json", help="write every figure here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = command_parser().parse_args(argv)
    variants = tuple(args.variants) if args.variants else DEFAULT_VARIANTS
    settings = Settings(args.model, variants, args.steps, args.rounds, args.every)
    figures = {}
    for network in args.networks.split(","):
        netem.check(network, 2)
        figures[network] = run(settings, network)
        sys.stdout.write(markdown(network, figures[network]) + "\n\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": dataclasses.asdict(settings), "figures": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
