"""``gradcomp explain``: what the engine does with each bucket of a model, and why.

    gradcomp explain "sign:ef=true,vectors=dense" --model transformer --ranks 8
    gradcomp explain "topk:ratio=0.01,ef=true,warmup=100" --model mlp --step 3
    gradcomp explain --rules

It prints the engine's own plan (:func:`gradcomp.engine.plan.plan_bucket`) of every bucket, in the
order backward hands them over: which tensors (by parameter name, pieces named as such) go which
route, at which keep-ratio, and why. Nothing is run and no rank is started: the buckets are DDP's
(its caps, 1 MiB then 25 MiB, gradients in reverse registration order), the ranks and node layout
those given. ``--rules`` prints the table of the combinations no surface plans, and where.
"""

from __future__ import annotations

import argparse
import math

import torch

from gradcomp.cost.step import Workload
from gradcomp.engine import rules
from gradcomp.engine.plan import BucketPlan, Context, plan_bucket, segments_of
from gradcomp.engine.spec import HookSpec


def explain(
    spec: HookSpec, named_shapes: list[tuple[str, torch.Size]], context: Context, step: int
) -> list[BucketPlan]:
    """Every bucket's plan for a model's trainable parameters ``named_shapes`` (registration order),
    bucketed as DDP buckets them, in the order backward hands them over."""
    ordered = list(reversed(named_shapes))
    buckets = Workload.uniform([s for _, s in named_shapes], 0.0).buckets()
    plans = []
    for index, members in enumerate(buckets):
        names, shapes = [ordered[i][0] for i in members], [ordered[i][1] for i in members]
        segments = segments_of(spec, sum(math.prod(s) for s in shapes), names, shapes)
        plans.append(plan_bucket(spec, context, step, segments, bucket=index, last=index == len(buckets) - 1))
    return plans


def _model(text: str) -> torch.nn.Module:
    from gradcomp.experiments.bench.workloads import PRESETS, user_model
    from gradcomp.experiments.tasks import build_task

    if text in PRESETS:
        return build_task("synthetic").build_model(PRESETS[text].model)
    return user_model(text, "1").build()  # the input shape is not needed: nothing runs


def _run(args: argparse.Namespace) -> int:
    if args.rules:
        for combination, where, reason in rules.table():
            print(f"{combination} [{where}]: {reason}")
        return 0
    if args.spec is None:
        raise ValueError("give a hook spec (gradcomp explain SPEC), or --rules")
    spec = HookSpec.parse(args.spec)
    if args.ranks < 1 or (spec.local_size > 1 and args.ranks % spec.local_size):
        raise ValueError(f"--ranks must be >= 1 and a multiple of local_size, got {args.ranks}")
    if not 0 <= args.local_rank < max(spec.local_size, 1):
        raise ValueError(f"--local-rank must be in 0..{max(spec.local_size, 1) - 1}, got {args.local_rank}")
    model = _model(args.model)
    named = [(name, p.shape) for name, p in model.named_parameters() if p.requires_grad]
    context = Context(args.ranks, args.local_rank, args.device == "cuda")
    step = spec.warmup if args.step is None else args.step
    print(f"{spec} on {args.ranks} ranks, {args.model} ({sum(math.prod(s) for _, s in named):,} parameters), "
          f"step {step}{' (past the warm-up)' if args.step is None and spec.warmup else ''}:")  # fmt: skip
    for plan in explain(spec, named, context, step):
        print(plan)
    return 0


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp explain`` (an entry point of the ``gradcomp.commands`` group)."""
    parser = commands.add_parser("explain", help="print what a hook spec does with each bucket of a model, and why")
    parser.add_argument("spec", nargs="?", help="a hook spec, e.g. 'topk:ratio=0.01,ef=true,min_numel=1024'")
    parser.add_argument("--model", default="mlp", help="a preset (mlp, cnn, transformer, gpt) or pkg.module:factory")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument("--local-rank", type=int, default=0, help="with local_size: the rank's index in its node")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: an accelerator's plan (payloads sized by their values are measured first)",
    )  # fmt: skip
    parser.add_argument("--step", type=int, help="the step to plan (default: the first past the warm-up)")
    parser.add_argument("--rules", action="store_true", help="print the combinations no surface plans, and why")
    parser.set_defaults(run=_run)
