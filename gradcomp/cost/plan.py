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
import itertools
from collections.abc import Callable, Sequence

from gradcomp.compressors import Aggregation
from gradcomp.cost import choose
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
    """The option a hook can run to recommend, and why (against the uncompressed ``baseline``): the
    baseline unless a method is predicted measurably faster (by :data:`MARGIN`), a lossy one only
    if it also beats the fastest method that keeps the training by :data:`LOSSY_MARGIN`. Every figure
    said is one of the table's (:func:`options`). Methods are named by ``name`` (default: their label)."""
    runnable = [o for o in found if o.available]
    if not runnable:
        raise ValueError("no candidate can run as a hook")
    choice = min(runnable, key=lambda o: o.step.step_s)
    reference = best(found, baseline)
    safe = [o for o in runnable if _keeps_the_training(o)]
    safest = min(safe, key=lambda o: o.step.step_s) if safe else None
    held_back, passed_over = "", []
    lossy = not _keeps_the_training(choice)
    if lossy and safest is not None and safest.step.step_s < LOSSY_MARGIN * choice.step.step_s:
        held_back = _held_back(choice, safest, LOSSY_MARGIN, LOSSY_RULE, name)
        passed_over.append(choice.method.label)
        choice = safest
    if reference is not None and choice is not reference and reference.step.step_s < MARGIN * choice.step.step_s:
        held_back += _held_back(choice, reference, MARGIN, MARGIN_RULE, name)
        passed_over.append(choice.method.label)
        choice = reference
    step = choice.step
    text = (
        f"{name(choice.method.label)} over {choice.route}: {step.step_s * 1e3:.1f} ms per step predicted, "
        f"{step.communication_share:.0%} of it beyond the model's compute, {step.sent_bytes / 1e6:.2f} MB sent per rank"
    )
    # a runner-up, unless one passed over (said below with its figures)
    text += _runner_up(choice, [o for o in runnable if o.method.label not in passed_over], name)
    if reference is None:  # nothing to compare against: say so, do not guess
        missing = f"{baseline} is not among the candidates: add it to compare with the uncompressed gradient"
        return choice, f"{text}; {missing}.{held_back}"
    if reference is choice:
        why = "nothing compressed is predicted faster than the uncompressed gradient: compression does not pay here"
        if held_back:
            why = f"nothing is predicted measurably faster than the uncompressed gradient (by {MARGIN - 1:.0%} or more)"
        return choice, f"{text}. {why.capitalize()}.{held_back}"
    gain = reference.step.step_s / step.step_s
    text += (
        f"; {gain:.2f}x faster per step than {baseline} over {reference.route} ({reference.step.step_s * 1e3:.1f} ms)"
    )
    if _keeps_the_training(choice):
        caveat = (
            f"a cast: the same training, {step.sent_bytes / 1e6:.2f} MB sent per rank against {baseline}'s "
            f"{reference.step.sent_bytes / 1e6:.2f} MB ({step.sent_bytes / reference.step.sent_bytes:.0%} of its bytes"
        )
        if choice.route.startswith("local_size="):
            caveat += ": only what crosses nodes is cast, the gradient travels uncompressed inside a node"
        caveat += ")"
    else:
        caveat = "lossy: per step only; check that it reaches your accuracy in as many steps (docs/results.md)"
    return choice, f"{text}. {caveat[0].upper()}{caveat[1:]}.{held_back}"


def _held_back(option: Option, instead: Option, margin: float, rule: str, name: Callable[[str], str]) -> str:
    """Why ``option``, predicted faster, is not recommended over ``instead``: its gain is below ``margin``."""
    gain = instead.step.step_s / option.step.step_s - 1
    return (
        f" {name(option.method.label)} over {option.route} is predicted {gain:.1%} faster "
        f"({option.step.step_s * 1e3:.1f} ms against {instead.step.step_s * 1e3:.1f} ms), less than the "
        f"{margin - 1:.0%} {rule}."
    )


MARGIN = 1 + choose.MARGIN
"""How much faster than the uncompressed gradient (the baseline's fastest route) a method must be
predicted to be recommended instead of it: 5%, about how much kernel timings vary from run to run
(:data:`CLOSE`), the margin the ``auto`` hook chooses with. A predicted 1.00x is the baseline, never
a method "1.00x faster"."""
MARGIN_RULE = "a method must win by to be told apart from the uncompressed gradient (kernel timings vary that much)"
LOSSY_RULE = "a lossy method must win by to be worth its accuracy risk (and the model's own error)"

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


def scaling_notes(
    curves: dict[str, list[tuple[int, Option]]], local_size: int, name: Callable[[str], str] = str
) -> list[str]:
    """Why a method's predicted step falls as ranks grow (by more than :data:`CLOSE`), where it does:
    one sentence per cause, its figures the scaling table's (ms per step as it rounds them) and the
    predictions' kernel times. The usual cause is the node: up to ``local_size`` ranks the cluster is
    one node, where no hook runs across nodes and each rank compresses and averages the whole
    gradient; from two nodes the hook across nodes (``local_size=L``) does that on its 1 / L."""
    across: dict[tuple[int, int], list[str]] = {}
    other = []
    for label, curve in curves.items():
        for (p0, before), (p1, after) in itertools.pairwise(curve):
            if after.step.step_s >= (1 - CLOSE) * before.step.step_s:
                continue
            ms = f"{name(label)} from {before.step.step_s * 1e3:.0f} to {after.step.step_s * 1e3:.0f} ms"
            if p0 <= local_size < p1 and after.route.startswith("local_size="):
                kernels = [(o.step.compress_s + o.step.decompress_s) * 1e3 for o in (before, after)]
                across.setdefault((p0, p1), []).append(
                    f"{ms} (its kernels from {kernels[0]:.1f} to {kernels[1]:.1f} ms)"
                )
            else:
                other.append(f"{ms} from {p0} to {p1} ranks ({before.route}, then {after.route})")
    notes = []
    for (p0, p1), falls in across.items():
        notes.append(
            f"Up to {local_size} ranks the cluster is one node: no hook runs across nodes there, and each rank "
            f"compresses and averages the whole gradient on backward's core. From {p1} ranks the hook across "
            f"nodes (local_size={local_size}) reduces inside each node first and compresses and averages only its "
            f"1/{local_size} of the gradient, so from {p0} to {p1} ranks the step falls: {'; '.join(falls)}."
        )
    if other:
        notes.append(f"Other steps that fall as ranks grow: {'; '.join(other)}.")
    return notes
