"""What a report says about a set of runs: groups, the target, time to target, speedups, the verdict.

A **group** is the runs of one task label, network, world size and parallel mode (DDP, FSDP2, HSDP:
each against its own baseline); within it, a **method** is a hook
spec, and its runs are its seeds. The **target** is the baseline's final metric (mean over its
finished seeds) less the tolerance: percentage points for accuracy, percent of the baseline's value
for other metrics (loss and perplexity count lower as better). A method's **time to target** is the
training time (steps only: evaluation and checkpoints excluded) at the first evaluation where the
mean over its finished seeds meets the target, the time itself a mean over the seeds: the baseline
always reaches it (its final mean is above the target by construction), and one unlucky seed does not
rule a method out. Each seed's own time to target (its first evaluation that meets the target) is
kept too, for the spread and the tests. Speedups are ratios of times to target: over the baseline,
and over the fastest of torch's hooks (``torch:...``). Spreads over seeds use scipy: a 95% Student-t
interval of the final metric, and Welch's t-test against the baseline (final metric) and against the
fastest torch hook (the seeds' times to target), and of the seeds' times to target against the
baseline's: the verdict (:mod:`~gradcomp.experiments.report.verdicts`) leads with a speedup only where
that test says it stands out of the noise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

from gradcomp.engine.sharded import SHARD_OPTIONS, ShardSpec
from gradcomp.engine.spec import ENGINE_OPTIONS, HookSpec
from gradcomp.experiments.report import verdicts
from gradcomp.experiments.report.records import Run
from gradcomp.experiments.training.config import OPTIMIZER_JOIN, split_method
from gradcomp.experiments.training.config import method as method_name
from gradcomp.hooks.compressed_adamw_spec import CompressedAdamWSpec
from gradcomp.hooks.torch_hooks import is_torch_spec
from gradcomp.options import format_value

BASELINES = ("torch:allreduce", "allreduce", "torch:reduce_scatter", "none")
"""The default baseline of a group: the first of these that it has (DDP's all-reduce, torch's and
gradcomp's, then FSDP2's reduce-scatter, FSDP2's own and gradcomp's)."""
CONFIDENCE = 0.95
DEFINING = ("ratio", "rank", "bits", "format", "tau")
"""Compressor options a method's short name keeps even at their defaults: they say how much is sent."""


@dataclasses.dataclass(frozen=True)
class Metric:
    """The headline metric of a group (the key in a run's final metrics, ``eval_accuracy``)."""

    key: str

    @property
    def name(self) -> str:
        """Its key in evaluation points (``accuracy``)."""
        return self.key.removeprefix("eval_")

    @property
    def higher_is_better(self) -> bool:
        return not any(word in self.name for word in ("loss", "perplexity"))

    @property
    def is_rate(self) -> bool:
        """A run's figure with no evaluation behind it (``steps_per_s``: a step-time study on
        synthetic data): there is no curve to reach a target on, so methods compare by the figure."""
        return not self.key.startswith("eval_")

    @property
    def percent(self) -> bool:
        """Shown in percent, its tolerance in percentage points."""
        return "accuracy" in self.name

    def target(self, baseline: float, tolerance: float) -> float:
        """``baseline`` less ``tolerance`` (percentage points, or percent of the baseline)."""
        if self.percent:
            return baseline - tolerance / 100
        margin = abs(baseline) * tolerance / 100
        return baseline - margin if self.higher_is_better else baseline + margin

    def meets(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def format(self, value: float | None) -> str:
        if value is None:
            return "-"
        return f"{100 * value:.2f}%" if self.percent else f"{value:.4g}"


@dataclasses.dataclass
class MethodRuns:
    """One method (hook spec) of a group: its seeds, and what they reached."""

    hook: str
    runs: list[Run]
    final: list[float] = dataclasses.field(default_factory=list)
    """The final metric of each finished run (in run order)."""
    times_to_target: list[float | None] = dataclasses.field(default_factory=list)
    """Each finished seed's own time to target (None: it never met it; empty: no target)."""
    final_ci: tuple[float, float] | None = None
    final_p: float | None = None
    """Welch's t-test of the final metric against the baseline's (two-sided); None where undefined."""
    time_to_target: float | None = None
    """Where the mean over seeds meets the target (None: never)."""
    speedup_vs_baseline: float | None = None
    speedup_vs_torch: float | None = None
    fewer_bytes: float | None = None
    """The baseline's wire bytes per step over this method's: over whole runs, warm-ups and the steps
    a synchronization skips included (the runs' ``compression_ratio`` is one exchange's)."""
    time_p: float | None = None
    """Welch's t-test of the time to target against the fastest torch hook's; None where undefined."""
    baseline_p: float | None = None
    """Welch's t-test of the seeds' times to target against the baseline's (of the headline figure, in
    a step-time study): whether :attr:`speedup_vs_baseline` stands out of the noise; None where undefined."""
    steps_to_target: float | None = None
    """The step (mean over seeds) at which the mean over seeds meets the target (None: never)."""

    @property
    def torch(self) -> bool:
        return is_torch_spec(self.hook)

    @property
    def name(self) -> str:
        """The hook spec as shown (:func:`short_name`)."""
        return short_name(self.hook)

    @property
    def finished(self) -> list[Run]:
        return [r for r in self.runs if r.status == "finished"]

    @property
    def failed(self) -> list[Run]:
        return [r for r in self.runs if r.status == "failed"]

    @property
    def unfinished(self) -> list[Run]:
        """Runs still to make or to finish (running, stopped, missing)."""
        return [r for r in self.runs if r.status not in ("finished", "failed")]

    @property
    def final_mean(self) -> float | None:
        return statistics.fmean(self.final) if self.final else None

    @property
    def final_std(self) -> float | None:
        return statistics.stdev(self.final) if len(self.final) > 1 else (0.0 if self.final else None)

    @property
    def reached(self) -> int:
        return sum(t is not None for t in self.times_to_target)

    def mean(self, key: str, scale: float = 1.0) -> float | None:
        """The mean over finished runs of a final metric (None where no run has it)."""
        values = [r.metrics[key] * scale for r in self.finished if r.metrics.get(key) is not None]
        return statistics.fmean(values) if values else None

    @property
    def step_ms(self) -> float | None:
        values = [1e3 * r.metrics["train_time_s"] / r.metrics["step"] for r in self.finished if r.metrics.get("step")]
        return statistics.fmean(values) if values else None

    @property
    def wire_mb_per_step(self) -> float | None:
        values = [r.metrics["wire_bytes"] / r.metrics["step"] / 1e6 for r in self.finished if r.metrics.get("step")]
        return statistics.fmean(values) if values else None

    @property
    def inter_node_mb_per_step(self) -> float | None:
        """MB a rank sent to other nodes per step, where the hook knew (hierarchical hooks)."""
        values = [r.metrics["inter_node_bytes"] / r.metrics["step"] / 1e6 for r in self.finished
                  if r.metrics.get("step") and r.metrics.get("inter_node_bytes") is not None]  # fmt: skip
        return statistics.fmean(values) if values else None

    @property
    def compress_ms(self) -> float | None:
        """Compression and decompression per step (None where the hook does not time them: torch's)."""
        parts = [self.mean("compress_ms"), self.mean("decompress_ms")]
        return None if parts[0] is None else sum(p or 0.0 for p in parts)

    @property
    def exposed_ms(self) -> float | None:
        """What a step costs beyond its compute and compression: the communication backward could not hide."""
        step, compute = self.step_ms, self.mean("compute_ms")
        if step is None or compute is None:
            return None
        return max(0.0, step - compute - (self.compress_ms or 0.0))


@dataclasses.dataclass
class Group:
    """The runs of one task label, network, world size and parallel mode."""

    label: str
    network: str
    world: int
    parallel: str
    metric: Metric | None
    methods: list[MethodRuns]
    baseline: str | None = None
    target: float | None = None
    fastest_torch: str | None = None
    verdict: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What a reader must know to trust the table: figures that contradict each other, ties that
    only say how coarse the evaluation is (:func:`verdicts.notes`)."""

    @property
    def title(self) -> str:
        ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
        return f"{self.label}, {self.network}, {ranks}" + ("" if self.parallel == "ddp" else f", {self.parallel}")

    def method(self, hook: str | None) -> MethodRuns | None:
        return next((m for m in self.methods if m.hook == hook), None)


def analyze(
    runs: Sequence[Run], tolerance: float = 0.5, baseline: str | None = None, metric: str | None = None
) -> list[Group]:
    """The groups of ``runs`` (in order of first appearance), each analysed against ``baseline``
    (a hook spec's canonical text; default: the first of :data:`BASELINES` that the group has) by
    ``metric`` (an evaluation metric's name, ``loss``; default: each task's headline)."""
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ValueError(f"the target tolerance must be a number >= 0, got {tolerance}")
    readable = [r for r in runs if r.status != "unreadable"]  # listed apart (page.render), compared nowhere
    keys = list(dict.fromkeys(r.group for r in readable))
    return [_group(key, [r for r in readable if r.group == key], tolerance, baseline, metric) for key in keys]


def _group(
    key: tuple[str, str, int, str], runs: list[Run], tolerance: float, baseline: str | None, chosen_metric: str | None
) -> Group:
    hooks = list(dict.fromkeys(r.hook for r in runs))
    methods = [MethodRuns(hook, [r for r in runs if r.hook == hook]) for hook in hooks]
    headline = next((r.metric for r in runs if r.metric), None)
    if chosen_metric and headline:  # a run that started names its task's metrics
        available = {k.removeprefix("eval_") for r in runs for k in r.metrics if k.startswith("eval_")}
        if available and chosen_metric not in available:
            raise ValueError(
                f"no evaluation metric {chosen_metric!r} in {key[0]}; valid: {', '.join(sorted(available))}"
            )
        headline = f"eval_{chosen_metric}"
    group = Group(*key, Metric(headline) if headline else None, methods)
    if group.metric is None:
        group.verdict = "No run of this group has started: nothing to compare yet."
        return group
    metric = group.metric
    for method in methods:
        _finals(method, metric)
    candidates = [baseline] if baseline else list(BASELINES)
    chosen = next((m for h in candidates if (m := group.method(h)) is not None and m.final), None)
    if chosen is None:
        group.verdict = f"No finished run of the baseline ({' or '.join(candidates)}) in this group: no target."
        return group
    group.baseline = chosen.hook
    assert chosen.final_mean is not None
    for method in methods:
        sent, base = method.wire_mb_per_step, chosen.wire_mb_per_step
        method.fewer_bytes = base / sent if base is not None and sent else None
        method.final_p = _welch(method.final, chosen.final) if method is not chosen else None
    group.notes = verdicts.notes(group)
    if metric.is_rate:
        for method in methods:
            if method.final_mean is not None and chosen.final_mean:
                method.speedup_vs_baseline = method.final_mean / chosen.final_mean
            method.baseline_p = method.final_p
        group.verdict = verdicts.rate_verdict(group)
        return group
    group.target = metric.target(chosen.final_mean, tolerance)
    for method in methods:
        method.times_to_target = [time_to_target(r.evals, metric, group.target) for r in method.finished]
        method.time_to_target = _mean_to_target(method, metric, group.target, "time_s")
        method.steps_to_target = _mean_to_target(method, metric, group.target, "step")
    torch_reached = [m for m in methods if m.torch and m.time_to_target is not None]
    fastest_torch = min(torch_reached, key=lambda m: m.time_to_target or math.inf, default=None)
    group.fastest_torch = fastest_torch.hook if fastest_torch else None
    for method in methods:
        if method.time_to_target is None:
            continue
        if chosen.time_to_target:
            method.speedup_vs_baseline = chosen.time_to_target / method.time_to_target
            if method is not chosen:
                method.baseline_p = _welch(_reached(method), _reached(chosen))
        if fastest_torch is not None and fastest_torch.time_to_target:
            method.speedup_vs_torch = fastest_torch.time_to_target / method.time_to_target
            if method is not fastest_torch:
                method.time_p = _welch(_reached(method), _reached(fastest_torch))
    group.verdict = verdicts.verdict(group)
    return group


def _mean_to_target(method: MethodRuns, metric: Metric, target: float, x: str) -> float | None:
    """Where the mean curve over the method's seeds first meets ``target``: its mean ``x`` there
    (``time_s``: the time to target; ``step``: the steps to it); None where it never does."""
    mean = curve(method.finished, "eval", metric.name, x)
    if mean is None:
        return None
    return next((at for at, y in zip(mean.x, mean.mean, strict=True) if metric.meets(y, target)), None)


def _finals(method: MethodRuns, metric: Metric) -> None:
    """The method's final values of ``metric`` over its finished runs, and their confidence interval."""
    method.final = [float(r.metrics[metric.key]) for r in method.finished if r.metrics.get(metric.key) is not None]
    if len(method.final) > 1 and statistics.stdev(method.final) > 0:
        from scipy import stats  # here: scipy.stats costs half a second at every start of the command line

        interval = stats.t.interval(CONFIDENCE, len(method.final) - 1, loc=method.final_mean,
                                    scale=stats.sem(method.final))  # fmt: skip
        method.final_ci = (float(interval[0]), float(interval[1]))


def time_to_target(evals: Sequence[dict[str, Any]], metric: Metric, target: float) -> float | None:
    """The training time of the first evaluation that meets ``target`` (None if none does)."""
    for point in evals:
        value = point.get(metric.name)
        if value is not None and metric.meets(value, target):
            return float(point["time_s"])
    return None


def _short_optimizer(text: str) -> str:
    """A compressing optimizer's spec with its carrier as :func:`short_name` writes hooks."""
    try:
        spec = CompressedAdamWSpec.parse(text)
    except ValueError:
        return text
    text = str(spec)
    for spec_text in (spec.carrier, spec.variance_carrier):
        text = text.replace(f"carrier={spec_text}", f"carrier={short_name(spec_text)}")
    return text


def short_name(hook: str) -> str:
    """A hook spec as a reader writes it: the canonical text less the options at their defaults, but
    for the ones that say how much is sent (:data:`DEFINING`): ``topk:ratio=0.01,ef=true`` for
    ``topk:ratio=0.01,method=exact,tolerance=0.2,ef=true``."""
    if is_torch_spec(hook):
        return hook
    sync, inner = split_method(hook)
    if sync is not None:  # local SGD or DiLoCo, over a hook spec
        return method_name({"sync": sync, "hook": short_name(inner)})
    optimizer, inner = split_method(hook, OPTIMIZER_JOIN)
    if optimizer is not None:  # an optimizer sending its momentum, after a hook's warm-up
        return method_name({"optimizer": _short_optimizer(optimizer), "hook": short_name(inner)})
    sharded: list[str] = []  # a sharded run's own options (local_size, param_bits)
    try:
        spec = HookSpec.parse(hook)
    except ValueError:
        try:
            parsed = ShardSpec.parse(hook)
        except ValueError:
            return hook
        spec, sharded = parsed.hook, [f"{key}={getattr(parsed, key)}" for key in SHARD_OPTIONS if getattr(parsed, key)]
    if spec.compressor is None or spec.compressor.name == "none":
        return hook
    config, defaults = spec.compressor.config, type(spec.compressor.config)()
    options = [
        f"{f.name}={format_value(getattr(config, f.name))}"
        for f in dataclasses.fields(config)
        if f.name in DEFINING or getattr(config, f.name) != getattr(defaults, f.name)
    ]
    options += spec.compressor.feedback.words()
    options += [f"{key}={getattr(spec, key)}" for key in ENGINE_OPTIONS
                if getattr(spec, key) != getattr(HookSpec(None), key)]  # fmt: skip
    options += sharded
    return spec.compressor.name + (":" + ",".join(options) if options else "")


def _reached(method: MethodRuns) -> list[float]:
    return [t for t in method.times_to_target if t is not None]


def _welch(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Welch's two-sided t-test p-value of ``a`` against ``b`` (None with fewer than two of either,
    or no spread at all: the test is undefined)."""
    if len(a) < 2 or len(b) < 2 or (statistics.stdev(a) == 0 and statistics.stdev(b) == 0):
        return None
    from scipy import stats  # here, as above

    with warnings.catch_warnings():  # scipy warns of lost precision where the seeds agree to many digits
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return p if math.isfinite(p) else None


@dataclasses.dataclass(frozen=True)
class Curve:
    """A method's curve over its seeds: at each step that every seed logged, the mean x (step, training
    time or wire bytes) and the mean, least and greatest y."""

    x: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]


def curve(runs: Sequence[Run], kind: str, y: str, x: str) -> Curve | None:
    """The mean curve of ``y`` against ``x`` (``step``, ``time_s`` or ``wire_bytes``) over ``runs``'
    ``kind`` points (``eval`` or ``train``); None where no run has any."""
    series = [{p["step"]: p for p in (r.evals if kind == "eval" else r.trains) if y in p} for r in runs]
    series = [s for s in series if s]
    if not series:
        return None
    steps = sorted(set.intersection(*(set(s) for s in series)))
    xs = [statistics.fmean(float(s[step][x]) for s in series) for step in steps]
    ys = [[float(s[step][y]) for s in series] for step in steps]
    return Curve(xs, [statistics.fmean(v) for v in ys], [min(v) for v in ys], [max(v) for v in ys])
