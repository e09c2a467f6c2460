"""What a report says of a group, in words: one verdict, and the notes a reader needs to trust its table.

A verdict leads with a gain only where the gain stands out of the seeds' noise (Welch's t-test of
the seeds' times to target against the baseline's, two-sided, below :data:`SIGNIFICANCE`); else it
leads with "Within the noise of BASELINE", and the ratio and its p-value follow as figures, not as
a claim. A method whose step is slower than the baseline's and that still reaches the target
sooner does so in fewer steps: the verdict says the slower step first, then the fewer steps, then
the time. :func:`notes` flags figures that cannot both be right (a step's compute above the step)
with their likely cause, and exact ties that only say how coarse the evaluation is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the analysis builds the groups and imports this module
    from gradcomp.experiments.report.analysis import Group, MethodRuns

SIGNIFICANCE = 0.05
"""A difference whose Welch p-value is this or more is within the seeds' noise: never a headline."""
COMPUTE_REPEATS = 5
"""Steps a run times without communication at its end (``Loop.compute_ms``), for the notes' wording."""


def verdict(group: Group) -> str:
    """One line: the method that reaches the target first and by how much where that stands out of
    the noise; plainly that nothing beats the baseline (or not measurably); or that nothing reached it."""
    assert group.metric is not None and group.target is not None
    target = f"the target ({group.metric.format(group.target)})"
    reached = sorted((m for m in group.methods if m.time_to_target is not None), key=lambda m: m.time_to_target or 0)
    if not reached:
        return f"No method reached {target} (in the mean over its seeds)."
    best, base = reached[0], group.method(group.baseline)
    assert base is not None  # the baseline reaches its own target: its final mean is above it
    ours = [m for m in reached if not m.torch and m.hook != group.baseline]
    also = f"; the fastest gradcomp method, {ours[0].name}, takes {ours[0].time_to_target:.2f} s" if ours else ""
    if best is base or best.speedup_vs_baseline is None or (base.time_to_target or 0) <= (best.time_to_target or 0):
        return f"Nothing beats {base.name} here: it reaches {target} first, in {base.time_to_target:.2f} s{also}."
    steps = _fewer_steps(best, base)
    if not significant(best.baseline_p):
        first = f"{steps} and is" if steps else "is"
        text = (
            f"Within the noise of {base.name}: nothing reaches {target} measurably sooner here. {best.name} "
            f"{first} first, in {best.time_to_target:.2f} s against {base.time_to_target:.2f} s "
            f"({best.speedup_vs_baseline:.2f}x, {_noise(best.baseline_p)})"
        )
        return text + (also if best.torch else "") + "."
    sooner = f"{best.speedup_vs_baseline:.2f}x sooner than {base.name} ({_p(best.baseline_p)})"
    if best.torch:
        text = f"Nothing beats {best.name} here: it {steps + ', and ' if steps else ''}reaches {target} first"
        return f"{text}, in {best.time_to_target:.2f} s, {sooner}{also}."
    text = f"{best.name} {steps + ', and ' if steps else ''}reaches {target} first, in {best.time_to_target:.2f} s: "
    text += sooner
    torch = group.method(group.fastest_torch)
    if torch is None:
        text += "; no torch hook reached it"
    elif torch is not base and best.speedup_vs_torch is not None:
        text += f", {best.speedup_vs_torch:.2f}x sooner than the fastest torch hook ({torch.name})"
        if not significant(best.time_p):
            text += f", within its noise ({_noise(best.time_p)})"
    return text + "."


def rate_verdict(group: Group) -> str:
    """One line for a step-time study (no evaluation): the method with the highest figure against the
    baseline's, leading with it only where it stands out of the seeds' noise."""
    assert group.metric is not None
    measured = [m for m in group.methods if m.final_mean is not None]
    best = max(measured, key=lambda m: m.final_mean or 0.0)
    figure = f"{group.metric.format(best.final_mean)} {group.metric.name}"
    study = f"A step-time study (no evaluation, so no target: methods compare by {group.metric.name})"
    base = group.method(group.baseline)
    assert base is not None
    if best is base:
        return f"{study}. Nothing is faster than {base.name} here: {figure}."
    ratio = f"{best.speedup_vs_baseline:.2f}x {base.name}'s" if best.speedup_vs_baseline else ""
    if not significant(best.baseline_p):
        return (
            f"{study}. Within the noise of {base.name}: nothing is measurably faster here. {best.name} is "
            f"highest, {figure} ({ratio + ', ' if ratio else ''}{_noise(best.baseline_p, 'finished')})."
        )
    return f"{study}. {best.name} is fastest: {figure}{', ' + ratio if ratio else ''} ({_p(best.baseline_p)})."


def significant(p: float | None) -> bool:
    """Whether a p-value says the difference stands out of the noise (None: untested, so no)."""
    return p is not None and p < SIGNIFICANCE


def _fewer_steps(method: MethodRuns, base: MethodRuns) -> str:
    """Where ``method``'s step is slower than the baseline's, what its lead comes from: fewer steps
    of a slower step, said before any "sooner"; else nothing."""
    slow, quick = method.step_ms, base.step_ms
    if slow is None or quick is None or slow <= quick:
        return ""
    text = f"takes slower steps than {base.name} ({slow:.2f} ms against {quick:.2f} ms)"
    if method.steps_to_target is not None and base.steps_to_target is not None:
        text += f" but fewer of them ({method.steps_to_target:.0f} against {base.steps_to_target:.0f})"
    return text


def _p(p: float | None) -> str:
    return "Welch p < 0.001" if p is not None and p < 0.001 else f"Welch p = {p:.3f}"


def _noise(p: float | None, seeds: str = "reached the target") -> str:
    """The p-value as the verdict says it; untested where the test is undefined (``seeds``: what a
    seed must have done to count)."""
    if p is None:
        return f"untested: fewer than two seeds of each {seeds}, or none differs"
    return f"Welch p = {p:.2f} over the seeds: within the noise"


def notes(group: Group) -> list[str]:
    """What contradicts itself or needs saying in the group's table: a compute above the step (with
    the likely cause), and methods tied exactly by a coarse evaluation."""
    found = []
    for method in group.methods:
        step, compute = method.step_ms, method.mean("compute_ms")
        if step is not None and compute is not None and compute > step:
            found.append(
                f"{method.name}: compute ms ({compute:.2f}) is above step ms ({step:.2f}), which includes "
                "it: the two cannot both be right. The step is the mean over the whole run; the compute is "
                f"timed in {COMPUTE_REPEATS} steps without communication after it ends (the slowest rank's "
                "median), so the likely cause is a machine busier then than during the run (other processes "
                "on the same cores). Its compute, compress and exposed comm ms are not to be trusted."
            )
    found += _ties(group)
    return found


def _ties(group: Group) -> list[str]:
    """Methods whose seeds end at exactly the same metric, seed for seed: on a small evaluation that
    says how coarse it is (one sample is a step of the accuracy), not that they train alike."""
    assert group.metric is not None
    tied: dict[tuple[float, ...], list[MethodRuns]] = {}
    for method in group.methods:
        if len(method.final) > 1 and len(method.final) == len(method.finished):
            tied.setdefault(tuple(method.final), []).append(method)
    found = []
    samples = next((r.eval_samples for m in group.methods for r in m.finished if r.eval_samples), None)
    for methods in tied.values():
        if len(methods) < 2:
            continue
        mean, std = methods[0].final_mean, methods[0].final_std
        figure = f"{group.metric.format(mean)} ± {group.metric.format(std)}"
        text = (
            f"{len(methods)} methods ({', '.join(m.name for m in methods)}) end at exactly the same "
            f"{group.metric.name}, seed for seed ({figure}), so their p vs the baseline is 1.000 or "
            "undefined between them: "
        )
        if samples and group.metric.percent:
            text += (
                f"the evaluation scores {samples} samples, so {group.metric.name} moves in steps of "
                f"{100 / samples:.2f} points (one sample), and these methods got the same samples right. "
                "A tie, or a gap of a few samples, says the evaluation is too coarse to tell them apart, "
                "not that they train alike."
            )
        else:
            text += "the evaluation is too coarse to tell them apart, which does not say that they train alike."
        found.append(text)
    return found
