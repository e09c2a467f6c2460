"""The roofline that prices kernels on a device this machine is not (``gradcomp plan --device``):
the kernels and bytes it counts against what the operators move by construction, its costs against
the device's bandwidth, and the plan the issue that asked for it gave wrongly with this CPU's kernels."""

from __future__ import annotations

import json

import pytest
import torch

from gradcomp import cli
from gradcomp.compressors import make_compressor
from gradcomp.cost.roofline import DEVICES, kernel_cost, traffic


def test_traffic_counts_each_kernel_and_the_bytes_it_reads_and_writes() -> None:
    x, out = torch.randn(1000), torch.empty(1000, dtype=torch.float16)
    # views; a copy (the reshape of a transpose); a cast into ``out``
    moved = traffic(lambda: out.copy_(x.view(10, 100).t().reshape(-1)))
    assert moved.kernels == 2 and moved.moved_bytes == 1000 * (4 + 4) + 1000 * (4 + 2)
    assert traffic(lambda: x.view(4, 250)[1:].t()) == type(moved)()  # views move nothing


def test_an_fp16_cast_costs_one_kernel_of_six_bytes_per_element() -> None:
    device = DEVICES["h100"]
    cost = kernel_cost("fp16", device, sides=(1024, 2048))
    for numel, seconds in zip(cost.numel, cost.compress_s, strict=True):
        assert seconds == pytest.approx(device.launch_s + 6 * numel / device.bandwidth)
    assert cost.compress(100e6) == pytest.approx(cost.compress_s[-1] * 100e6 / cost.numel[-1])  # beyond: linear


def test_the_count_is_the_accelerators_paths() -> None:
    """Exact top-k on an accelerator is torch.topk: no host read, and so no prefilter's kernels."""
    compressor = make_compressor("topk:ratio=0.01")
    x = torch.randn(1 << 18)
    moved = traffic(lambda: compressor.compress(x))
    assert moved.kernels <= 6


def test_plan_on_h100_prices_a_cast_below_the_all_reduce_it_halves(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """With this CPU's kernels the plan said that an fp16 cast makes a 125M-parameter step 2.5x slower
    than the uncompressed all-reduce over 25 Gbit/s; on an H100 the cast is a fraction of a millisecond."""
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--params", "125M", "--compute-ms", "300", "--ranks", "64", "--nodes", "8x8",
                     "--net", "25gbit", "--intra", "600GB/s", "--device", "h100", "--candidates", "allreduce;fp16",
                     "--torch-hooks", "none", "--json", str(out)])  # fmt: skip
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["device"] == "h100" and figures["kernels_kind"] == "estimate"
    assert "roofline" in figures["kernels"] and "estimate until calibrated" in capsys.readouterr().out
    native = {o["method"]: o["step_s"] for o in figures["options"] if o["route"] == "native"}
    assert native["fp16"] < native["allreduce"]
    # ... by less than the margin a method must win by: the plan keeps the all-reduce and says why
    recommendation = figures["recommendation"]
    assert recommendation["method"] == "allreduce" and "fp16 over local_size=8 is predicted" in recommendation["reason"]


def test_a_profile_calibrated_on_a_gpu_gives_the_kernels_for_a_gpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``gradcomp calibrate --device cuda`` times the kernels on the GPU: the plan then takes them
    (calibrated), not the roofline; a profile timed on a CPU gives the link only."""
    from gradcomp.collectives.cost_model import LinkCosts
    from gradcomp.cost.kernels import KernelCost
    from gradcomp.cost.profile import LinkFit, Profile
    from gradcomp.experiments.plan.command import _kernels

    kernel = KernelCost((1, 1 << 20), (1e-5, 1e-4), (0.0, 0.0), (1e-5, 1e-4), (0.0, 0.0))
    links = {"all_reduce": LinkFit(LinkCosts(1e-4, 8e-9), 0, 0, 0)}
    on_gpu = Profile("gpu", "loopback", 2, links, {"fp16": kernel}, {"kernel_device": "cuda: NVIDIA H100"})
    table, source, kind = _kernels("h100", on_gpu, "gpu.json")
    assert kind == "calibrated" and "NVIDIA H100" in source and table("fp16") == kernel
    on_cpu = Profile("cpu", "loopback", 2, links, {"fp16": kernel}, {"kernel_device": "cpu"})
    table, source, kind = _kernels("h100", on_cpu, "cpu.json")
    assert kind == "estimate" and "timed on a CPU: not used" in source and table("fp16") != kernel
