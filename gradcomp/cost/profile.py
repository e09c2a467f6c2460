"""Calibration profiles: a link's latency and bandwidth and the compressors' kernel costs, as JSON.

``gradcomp calibrate`` writes one (:mod:`gradcomp.cost.calibrate`); ``gradcomp plan``, the
validation benchmark and the ``auto`` hook read it. A profile is plain JSON, named, and keeps the
timings it was fitted from, so it can be inspected, re-fitted or compared::

    {"name": "1gbit", "format": 1, "network": "1gbit", "ranks": 2, "machine": {...},
     "links": {"all_reduce": {"alpha": 2.1e-4, "beta": 8.3e-9, "rel_error": 0.04}, "all_gather": {...}},
     "kernels": {"fp16": {"c0": ..., "c1": ..., "d0": ..., "d1": ..., "d2": 0.0}, ...},
     "samples": {"all_reduce": [[bytes, seconds], ...], "kernels": {"fp16": [...]}}}

Links are fitted to the closed forms of the backend's ring (:mod:`gradcomp.cost.cluster`) with the
Theil-Sen estimator (``scipy.stats.theilslopes``: robust to timings gone astray), latency and
bandwidth clipped to be non-negative: all-reduce ``t = 2 (p - 1) alpha + 2 (p - 1) / p n beta``, all-gather
``t = (p - 1) (alpha + c beta)``. The reduction's own cost (gamma) is folded into beta.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import KernelCost

FORMAT = 1
COLLECTIVES = ("all_reduce", "all_gather")


def _steps_and_share(collective: str, ranks: int) -> tuple[float, float]:
    """(messages, bytes sent per byte of tensor) of the backend's ring ``collective`` on ``ranks``."""
    if collective == "all_reduce":
        return 2 * (ranks - 1), 2 * (ranks - 1) / ranks
    if collective == "all_gather":
        return ranks - 1, ranks - 1
    raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")


@dataclasses.dataclass(frozen=True)
class LinkFit:
    """A link fitted from timings: its costs, their standard errors, and the fit's median relative error."""

    costs: LinkCosts
    alpha_stderr: float
    beta_stderr: float
    rel_error: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf when beta is 0)."""
        return 1 / self.costs.beta if self.costs.beta else float("inf")


def fit_link(collective: str, ranks: int, sizes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Latency and inverse bandwidth of the link under ``collective`` timings on ``ranks`` ranks.

    ``sizes`` are the tensor's bytes per rank (all-reduce) or each rank's contribution (all-gather).
    Needs at least two distinct sizes; raises ValueError otherwise.
    """
    if ranks < 2:
        raise ValueError(f"a link is fitted from collectives between >= 2 ranks, got {ranks}")
    x, t = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if x.shape != t.shape or len(set(x.tolist())) < 2 or (t <= 0).any():
        raise ValueError("fitting a link needs positive timings at two or more distinct sizes")
    messages, share = _steps_and_share(collective, ranks)
    # Bandwidth: Theil-Sen, the median of the slopes between every pair of sizes. On a shared machine
    # a few timings go astray (a rank's thread woken late costs milliseconds), and an emulated link
    # lets a burst of small messages through at once; least squares would bend to them, the median
    # of slopes does not. Latency: with that slope, the intercept that minimizes the relative
    # errors' absolute sum (a median weighted by 1 / t), so that the small sizes, where latency is
    # all there is, decide it rather than the large ones' noise.
    from scipy.stats import theilslopes  # here: scipy.stats costs half a second at every import of gradcomp

    slope, _, low, high = theilslopes(t, x, alpha=0.68)
    if slope <= 0:
        raise ValueError(
            f"{collective} times do not grow with size ({', '.join(f'{v * 1e3:.3g} ms' for v in t)}): the link "
            "cannot be fitted from them; time larger sizes or more repeats"
        )
    slope = float(slope)
    intercept = max(0.0, _weighted_median(t - slope * x, 1 / t))
    alpha, beta = intercept / messages, slope / share
    relative = float(np.median(np.abs(intercept + slope * x - t) / t))
    slope_error = (high - low) / 2 / share  # the 68% interval's half-width: about one standard error
    small = t <= np.median(t)  # the latency's spread where it weighs most
    alpha_error = float(np.std(t[small] - slope * x[small]) / np.sqrt(small.sum())) / messages
    errors = (alpha_error, slope_error)
    return LinkFit(LinkCosts(alpha, beta), float(errors[0]), float(errors[1]), relative)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at which half the total weight lies on each side (the lower one on a tie)."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


Timings = dict[str, list[list[float]]]
"""Per collective, [bytes per rank, seconds] per size (:func:`gradcomp.cost.calibrate.time_collectives`)."""


def fit_links(timings: Mapping[str, Sequence[Sequence[float]]], ranks: int) -> dict[str, LinkFit]:
    """:func:`fit_link` of every collective's timings."""
    return {name: fit_link(name, ranks, [s for s, _ in rows], [t for _, t in rows]) for name, rows in timings.items()}


INSIDE = "inside_"
"""The prefix of a profile's links fitted inside a node (calibrated on an emulated cluster)."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """A calibrated machine and link: what :class:`gradcomp.cost.cluster.Cluster` and the step model need."""

    name: str
    network: str
    ranks: int
    links: Mapping[str, LinkFit]
    """Per collective (``all_reduce``, ``all_gather``): the backend's own, fitted; on an emulated
    cluster also inside a node (``inside_all_reduce``, ``inside_all_gather``: :data:`INSIDE`)."""
    kernels: Mapping[str, KernelCost]
    """Per canonical compressor spec: its kernels' costs on this machine."""
    machine: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    samples: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The timings everything was fitted from (plain lists)."""

    def link(self, collective: str = "all_reduce") -> LinkCosts:
        if collective not in self.links:
            raise ValueError(f"profile {self.name!r} has no {collective} link; it has {', '.join(self.links)}")
        return self.links[collective].costs

    def cluster(self, ranks: int | None = None) -> Cluster:
        """``ranks`` ranks (default: as calibrated), each its own node behind the calibrated link,
        the backend's collectives priced by their own fits."""
        link = self.link("all_reduce")
        gather = self.links["all_gather"].costs if "all_gather" in self.links else None
        return Cluster(ranks or self.ranks, link, native_all_reduce=link, native_all_gather=gather)

    def kernel(self, spec: str) -> KernelCost | None:
        """The kernel cost of a canonical spec, or None when this profile did not time it."""
        return self.kernels.get(spec)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "format": FORMAT,
            "network": self.network,
            "ranks": self.ranks,
            "machine": dict(self.machine),
            "links": {
                name: {
                    **dataclasses.asdict(fit.costs),
                    "alpha_stderr": fit.alpha_stderr,
                    "beta_stderr": fit.beta_stderr,
                    "rel_error": fit.rel_error,
                }
                for name, fit in self.links.items()
            },
            "kernels": {spec: cost.as_dict() for spec, cost in self.kernels.items()},
            "samples": dict(self.samples),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "profile") -> Profile:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"{source} is not a gradcomp calibration profile (format {FORMAT})")
        try:
            links = {
                name: LinkFit(LinkCosts(float(v["alpha"]), float(v["beta"])), float(v.get("alpha_stderr", 0)),
                              float(v.get("beta_stderr", 0)), float(v.get("rel_error", 0)))
                for name, v in data["links"].items()
            }  # fmt: skip
            kernels = {spec: KernelCost.from_dict(v) for spec, v in data.get("kernels", {}).items()}
            return cls(str(data["name"]), str(data["network"]), int(data["ranks"]), links, kernels,
                       data.get("machine", {}), data.get("samples", {}))  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source} is not a valid calibration profile: {error!r}") from error

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as file:
            json.dump(self.to_json(), file, indent=1)
            file.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            with open(path) as file:
                data = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the calibration profile {os.fspath(path)!r}: {error}") from error
        return cls.from_json(data, repr(os.fspath(path)))
