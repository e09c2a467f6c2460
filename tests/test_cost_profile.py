"""Calibration fits: known latency and bandwidth recovered from synthetic timings; profiles as JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.cost.kernels import KernelCost
from gradcomp.cost.profile import LinkFit, Profile, fit_link

SIZES = np.array([4e3, 32e3, 256e3, 1e6, 4e6, 16e6])


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_recovers_a_known_link_from_noisy_timings(ranks: int) -> None:
    alpha, beta = 150e-6, 8e-9  # 150 us, 125 MB/s
    rng = np.random.default_rng(ranks)
    reduce = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * SIZES * beta
    gather = (ranks - 1) * (alpha + SIZES * beta)
    for collective, exact in (("all_reduce", reduce), ("all_gather", gather)):
        noisy = exact * (1 + 0.02 * rng.standard_normal(len(SIZES)))
        fit = fit_link(collective, ranks, SIZES, noisy)
        assert fit.costs.alpha == pytest.approx(alpha, rel=0.15)
        assert fit.costs.beta == pytest.approx(beta, rel=0.05)
        assert fit.rel_error < 0.05 and fit.beta_stderr < 0.1 * beta


def test_a_timing_gone_astray_does_not_bend_the_bandwidth() -> None:
    alpha, beta = 100e-6, 8e-9
    times = 2 * alpha + SIZES * beta
    times[0] *= 15  # a small collective whose thread was woken late
    fit = fit_link("all_reduce", 2, SIZES, times)
    assert fit.costs.beta == pytest.approx(beta, rel=0.02)
    assert fit.bandwidth == pytest.approx(1 / beta, rel=0.02)


def test_fit_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match=">= 2 ranks"):
        fit_link("all_reduce", 1, SIZES, SIZES)
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_link("all_reduce", 2, [1e3, 1e3], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="positive timings"):
        fit_link("all_reduce", 2, [1e3, 1e4], [1e-3, 0.0])
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_link("all_reduce", 2, [1e3, 1e6], [2e-3, 1e-3])
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        fit_link("broadcast", 2, SIZES, SIZES * 1e-9)


def test_profiles_round_trip_through_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    kernel = KernelCost((10, 100), (1e-5, 1e-4), (0.0, 0.0), (2e-5, 2e-4), (1e-5, 1e-4), (100,), (3e-4,))
    profile = Profile("lab", "1gbit", 2, {"all_reduce": LinkFit(LinkCosts(1e-4, 8e-9), 1e-5, 1e-10, 0.03)},
                      {"fp16": kernel}, {"cpu": "test"}, {"all_reduce": [[4096.0, 1e-4]]})  # fmt: skip
    path = tmp_path / "lab.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.kernel("fp16") == kernel and loaded.kernel("sign") is None
    assert loaded.cluster(4).ranks == 4 and loaded.cluster().native_all_reduce == LinkCosts(1e-4, 8e-9)
    with pytest.raises(ValueError, match="no all_gather link"):
        loaded.link("all_gather")
    (tmp_path / "other.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(ValueError, match="not a gradcomp calibration profile"):
        Profile.load(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text(json.dumps({"format": 1, "name": "x"}))
    with pytest.raises(ValueError, match="not a valid calibration profile"):
        Profile.load(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="cannot read"):
        Profile.load(tmp_path / "absent.json")
    edited = profile.to_json()
    edited["links"]["all_reduce"]["beta"] = float("nan")  # a hand-edited profile: refused, not NaN predictions
    (tmp_path / "nan.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="must be finite numbers >= 0"):
        Profile.load(tmp_path / "nan.json")
