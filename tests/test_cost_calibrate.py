"""Calibration on real ranks, its command, and the validation benchmark that checks the model's predictions."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import pytest
import torch

from gradcomp import cli
from gradcomp.cost import calibrate
from gradcomp.cost.profile import Profile
from gradcomp.cost.step import Workload, method_of, predict
from gradcomp.experiments.bench import predict as validation
from gradcomp.progress import Progress
from tests.distributed import spawn_ranks

SPECS = ("none", "fp16")


TERMINAL = io.StringIO()
"""What the calibration of :func:`profile` showed on a terminal."""


@pytest.fixture(scope="module")
def profile() -> Profile:
    """A small calibration on loopback at 2 ranks (seconds, not the default minute)."""
    with Progress("calibrate", calibrate.units(SPECS), stream=TERMINAL, enabled=True, tick=0, columns=200) as progress:
        return calibrate.calibrate(
            "loopback", 2, sizes=(4096, 4 << 20, 16 << 20), repeats=5, specs=SPECS, kernel_repeats=2,
            kernel_sides=(32, 128, 512), engine_sides=(64, 256), progress=progress,
        )  # fmt: skip


def test_a_calibration_says_what_it_times_from_the_parent(profile: Profile) -> None:
    """The links first, then each spec's kernels and engine, each in ranks the parent starts."""
    lines = [line for line in TERMINAL.getvalue().split("\r\x1b[K") if line]
    running = [line.split("  ")[1:3] for line in lines]
    assert running == [
        ["0/3", "loopback: all-reduce and all-gather at 3 sizes"],
        ["1/3", "loopback: all-reduce and all-gather at 3 sizes"],
        ["1/3", "kernels and engine of none (1 of 2)"],
        ["2/3", "kernels and engine of none (1 of 2)"],
        ["2/3", "kernels and engine of fp16 (2 of 2)"],
        ["3/3", "kernels and engine of fp16 (2 of 2)"],
    ]
    assert "ETA" in lines[-1] and TERMINAL.getvalue().endswith("\r\x1b[K")
    assert calibrate.units(["sign", "sign:chunk=1024", "none"]) == 1 + 2  # canonical specs, each once


def test_a_calibration_fits_the_link_and_times_the_kernels(profile: Profile) -> None:
    assert profile.name == "loopback-2ranks" and profile.ranks == 2
    for collective in ("all_reduce", "all_gather"):
        fit = profile.links[collective]
        assert fit.costs.alpha >= 0 and 0 < fit.costs.beta < math.inf and math.isfinite(fit.rel_error)
        assert len(profile.samples[collective]) == 3
    assert set(profile.kernels) == set(SPECS)
    fp16 = profile.kernels["fp16"]
    assert fp16.numel == (32 * 32, 128 * 128, 512 * 512) and min(fp16.compress_s) > 0
    assert fp16.bucket_numel == (64 * 64, 256 * 256)
    assert "all_reduce" in calibrate.describe(profile)


def test_the_engine_overhead_closes_the_gap_to_the_engines_own_timing(profile: Profile) -> None:
    # by construction: the model of one bucket, overhead included, is the engine's measured time
    cluster = profile.cluster()
    for spec in SPECS:
        for numel, seconds in profile.samples["engine"][spec]:
            side = math.isqrt(int(numel))
            bucket = Workload(((side, side),), (1.0,), 0.0, 0.0)
            step = predict(bucket, method_of(spec), cluster, profile.kernels.__getitem__)
            assert step.step_s == pytest.approx(seconds, rel=1e-9)


def nodes_timed(rank: int, world: int) -> dict[str, object]:
    """Every rank's part of a calibration of 2 nodes x 2 ranks, tiny."""
    timed = calibrate.time_everything(rank, world, [4096, 65536], 2, ["none"], 1, ((32,), (64,)), "cpu", 2)
    return {"failures": [], "inside": timed[3], "across": timed[0]}


def test_a_calibration_on_nodes_times_the_link_inside_a_node_too() -> None:
    inside = spawn_ranks(4, nodes_timed, timeout=120)[0]["inside"]
    assert set(inside) == {"all_reduce", "all_gather"}
    for rows in inside.values():
        assert [int(size) for size, _ in rows] == [4096, 65536] and all(seconds > 0 for _, seconds in rows)


def test_profiles_survive_the_file(profile: Profile, tmp_path: Path) -> None:
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == dataclasses.replace(
        profile, samples=Profile.load(tmp_path / "p.json").samples
    )


def test_bad_calibrations_are_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="--ranks must be >= 2"):
        calibrate.calibrate("loopback", 1)
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        calibrate.calibrate("loopback", 2, sizes=(4096,))
    with pytest.raises(ValueError, match="unknown compressor"):
        calibrate.calibrate("loopback", 2, specs=["zip"])
    with pytest.raises(ValueError, match="--device must be cpu or cuda"):
        calibrate.calibrate("loopback", 2, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            calibrate.calibrate("loopback", 2, device="cuda")


def test_the_calibrate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lo.json"
    code = cli.main(["calibrate", "--net", "loopback", "--sizes", "4KiB,16MiB", "--repeats", "5",
                     "--specs", "fp16", "-o", str(out), "--name", "here"])  # fmt: skip
    assert code == 0 and "written to" in capsys.readouterr().out
    assert Profile.load(out).name == "here" and set(Profile.load(out).kernels) == {"fp16"}
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--net", "loopback,1gbit", "-o", str(out)])
    assert "one network profile at a time" in capsys.readouterr().err


def test_the_validation_benchmark_predicts_every_variant(profile: Profile, tmp_path: Path) -> None:
    profile.save(tmp_path / "loopback-2ranks.json")  # reused: no calibration in the run
    rows = validation.run(["mlp"], [2], ["loopback"], ["fp16"], [], profiles=str(tmp_path), steps=4, warmup=2,
                          rounds=2)  # fmt: skip
    assert [r.variant for r in rows] == ["noop", "torch:allreduce", "fp16"]
    noop = rows[0]
    assert noop.predicted_ms == pytest.approx(noop.measured_ms) == pytest.approx(noop.compute_ms)  # the input
    for row in rows[1:]:
        assert row.measured_ms and row.predicted_ms > row.compute_ms  # communication adds to the step
        assert row.error == pytest.approx((row.predicted_ms - row.measured_ms) / row.measured_ms)
    table = validation.format_table(rows)
    assert "noop" not in table and "torch:allreduce" in table
    # a variant that failed: its error's cell says so in a word, the reason below the table
    reason = "aborted: ValueError: torch's PowerSGD hook hangs on gloo when DDP splits the gradients into buckets"
    refused = dataclasses.replace(rows[-1], variant="torch:powersgd:rank=4", measured_ms=None, status=reason)
    table = validation.format_table([*rows, refused])
    assert "| aborted [1] |" in table and table.endswith(f"\n\n[1] torch:powersgd:rank=4 (mlp): {reason}")
    assert "predictions within 25%" in validation.summary(rows)
