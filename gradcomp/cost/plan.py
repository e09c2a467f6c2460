"""The planner: every compressor with every algorithm, predicted on a cluster, and a recommendation.

:func:`options` prices each candidate method (a gradcomp hook spec, or one of torch's hooks as the
hooks layer describes it) with each way its payloads can travel: the all-reduce algorithms for
``sum`` payloads (the ones a hook can ask for, and ``hierarchical`` and ``in_network``, which the
model predicts but gradcomp's hooks do not run), all-gather or two-phase for ``gather`` payloads,
and on nodes the hook across nodes (``local_size``: uncompressed inside a node, compressed between).
:func:`recommend` picks the fastest one a hook can run and says why; :func:`scaling` follows each
method's best option from 2 to 4096 ranks. Everything is a prediction of
:func:`gradcomp.cost.step.predict`: step time, not accuracy (a lossy compressor may need more steps
to reach the same accuracy: the time-to-accuracy study in ``docs/results.md`` measures that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from gradcomp.compressors import Aggregation
from gradcomp.cost.cluster import ALL_REDUCE, Cluster
from gradcomp.cost.kernels import KernelCost
from gradcomp.cost.step import Method, StepPrediction, Workload, predict
from gradcomp.engine import rules

CANDIDATES = (
    "allreduce",
    "fp16",
    "bf16",
    "powersgd:rank=4,ef=true",
    "topk:ratio=0.01,ef=true",
    "sign:ef=true",
    "quantize:bits=4,ef=true",
    "randomk:ratio=0.01,scale=false,ef=true",
)
"""gradcomp's hooks the planner compares by default: lossless casts and error-feedback-protected ones."""
HOOK_ALGORITHMS = ("native", "ring", "tree", "halving_doubling")
"""All-reduce algorithms a hook spec can ask for (``algo=``); the others are predicted only."""
SCALING_RANKS = tuple(2**k for k in range(1, 13))
"""World sizes of the scaling curves: 2 to 4096."""


@dataclasses.dataclass(frozen=True)
class Option:
    """A method with one way of moving its payloads, and its predicted step."""

    method: Method
    route: str
    """The all-reduce algorithm, or ``all_gather`` / ``two_phase`` for gather payloads."""
    available: bool
    """Whether a hook runs it (False: predicted only, e.g. in-network reduction)."""
    step: StepPrediction

    @property
    def label(self) -> str:
        return f"{self.method.label} [{self.route}]"


def routes(method: Method, cluster: Cluster, torch_hook: bool = False) -> list[tuple[str, bool, Method]]:
    """The ways ``method``'s payloads can travel on ``cluster``: (route, available, priced method)."""
    if method.compressor is None:
        return [("none", True, method)]
    if torch_hook:  # torch's hooks run on DDP's (the backend's) all-reduce
        return [("native", True, method)]
    found = []
    if method.compressor.capabilities.aggregation is Aggregation.GATHER:
        for route, aggregation in (("all_gather", "gather"), ("two_phase", "two_phase")):
            spec = rules.derive(method.spec, rules.Surface.DDP, aggregation=aggregation)
            if spec is not None:  # None: a route the rules refuse (EF21 takes each aggregate once: not two-phase)
                found.append((route, True, dataclasses.replace(method, spec=spec)))
    else:
        for algo in ALL_REDUCE:
            if algo == "hierarchical" and (cluster.local_size == 1 or cluster.nodes == 1):
                continue  # the same as the ring there
            found.append((algo, algo in HOOK_ALGORITHMS, dataclasses.replace(method, algo=algo)))
    if cluster.local_size > 1 and cluster.nodes > 1 and method.spec.local_size <= 1:
        # the hook across nodes: uncompressed inside each, compressed between them
        spec = rules.derive(method.spec, rules.Surface.DDP, local_size=cluster.local_size)
        if spec is not None:
            found.append((f"local_size={cluster.local_size}", True, dataclasses.replace(method, spec=spec)))
    return found


def options(
    workload: Workload,
    cluster: Cluster,
    methods: Sequence[Method],
    kernels: Callable[[str], KernelCost],
    torch_hooks: Sequence[str] = (),
) -> list[Option]:
    """Every method on every route, predicted; ``torch_hooks`` names the methods that are torch's."""
    found = []
    for method in methods:
        for route, available, priced in routes(method, cluster, method.label in torch_hooks):
            found.append(Option(method, route, available, predict(workload, priced, cluster, kernels)))
    return found


def best(found: Sequence[Option], label: str, available_only: bool = True) -> Option | None:
    """The fastest option of the method ``label``."""
    mine = [o for o in found if o.method.label == label and (o.available or not available_only)]
    return min(mine, key=lambda o: o.step.step_s) if mine else None


def recommend(
    found: Sequence[Option], baseline: str = "allreduce", name: Callable[[str], str] = str
) -> tuple[Option, str]:
    """The fastest option a hook can run, and why (against the uncompressed ``baseline``). Methods are
    named by ``name`` (default: their label)."""
    runnable = [o for o in found if o.available]
    if not runnable:
        raise ValueError("no candidate can run as a hook")
    choice = min(runnable, key=lambda o: o.step.step_s)
    reference = best(found, baseline)
    safe = [o for o in runnable if _keeps_the_training(o)]
    safest = min(safe, key=lambda o: o.step.step_s) if safe else None
    held_back = ""
    lossy = not _keeps_the_training(choice)
    if lossy and safest is not None and safest.step.step_s < LOSSY_MARGIN * choice.step.step_s:
        gain = safest.step.step_s / choice.step.step_s - 1
        held_back = (
            f" {name(choice.method.label)} is predicted {gain:.0%} faster, less than the {LOSSY_MARGIN - 1:.0%} "
            "a lossy method must win by to be worth its accuracy risk (and the model's own error)."
        )
        choice = safest
    step = choice.step
    text = (
        f"{name(choice.method.label)} over {choice.route}: {step.step_s * 1e3:.1f} ms per step predicted, "
        f"{step.communication_share:.0%} of it beyond the model's compute, {step.sent_bytes / 1e6:.2f} MB sent per rank"
    )
    text += _runner_up(choice, runnable, name)
    if reference is None:  # nothing to compare against: say so, do not guess
        missing = f"{baseline} is not among the candidates: add it to compare with the uncompressed gradient"
        return choice, f"{text}; {missing}.{held_back}"
    if reference is choice:
        why = "nothing compressed is predicted faster than the uncompressed gradient: compression does not pay here"
        if held_back:
            why = "nothing compressed is predicted enough faster than the uncompressed gradient"
        return choice, f"{text}. {why.capitalize()}.{held_back}"
    gain = reference.step.step_s / step.step_s
    text += (
        f"; {gain:.2f}x faster per step than {baseline} over {reference.route} ({reference.step.step_s * 1e3:.1f} ms)"
    )
    caveat = (
        "a cast: the same training, half the bytes"
        if _keeps_the_training(choice)
        else "lossy: per step only; check that it reaches your accuracy in as many steps (docs/results.md)"
    )
    return choice, f"{text}. {caveat.capitalize()}.{held_back}"


LOSSY_MARGIN = 1.10
"""How much faster than the fastest method that keeps the training (the uncompressed gradient, a
cast) a lossy method must be predicted to be recommended: 10%, beyond the planner's error on
comparisons and worth an accuracy risk."""

CLOSE = 0.05
"""A runner-up predicted within this of the choice is named: kernel timings vary from run to run by
about as much, so the order of the two may too."""


def _keeps_the_training(option: Option) -> bool:
    """Uncompressed, or a cast: the same training (to rounding), whatever the step costs (noop,
    which sends nothing, does not: its replicas drift apart)."""
    compressor = option.method.compressor
    return compressor is not None and compressor.name in ("none", "fp16", "bf16") and not compressor.ef


def _runner_up(choice: Option, runnable: Sequence[Option], name: Callable[[str], str]) -> str:
    """The next method within :data:`CLOSE` of the choice, said (the answer's stability), or nothing."""
    others = sorted((o for o in runnable if o.method.label != choice.method.label), key=lambda o: o.step.step_s)
    for other in others:
        if abs(other.step.step_s / choice.step.step_s - 1) <= CLOSE:
            return (f" ({name(other.method.label)} over {other.route} is within {CLOSE:.0%}, "
                    f"{other.step.step_s * 1e3:.1f} ms: the two may trade places from run to run)")  # fmt: skip
    return ""


def scaling(
    workload: Workload,
    cluster_at: Callable[[int], Cluster],
    methods: Sequence[Method],
    kernels: Callable[[str], KernelCost],
    ranks: Sequence[int] = SCALING_RANKS,
    torch_hooks: Sequence[str] = (),
) -> dict[str, list[tuple[int, Option]]]:
    """Per method, its fastest runnable option at each world size of ``ranks``."""
    curves: dict[str, list[tuple[int, Option]]] = {m.label: [] for m in methods}
    for p in ranks:
        found = options(workload, cluster_at(p), methods, kernels, torch_hooks)
        for method in methods:
            choice = best(found, method.label)
            if choice is not None:
                curves[method.label].append((p, choice))
    return curves
