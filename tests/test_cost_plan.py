"""The planner: routes per method, the recommendation where the link is free or dear, scaling, the command."""

from __future__ import annotations

import json

import pytest

from gradcomp import cli
from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.cost import plan
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import FREE, KernelCost
from gradcomp.cost.profile import INSIDE, LinkFit, Profile
from gradcomp.cost.step import Workload, method_of
from gradcomp.experiments.plan.command import layers
from gradcomp.hooks.torch_hooks import TorchHookSpec

WORKLOAD = Workload.uniform([(2048, 2048)] * 6, compute_s=0.15)
METHODS = [method_of(s) for s in ("allreduce", "fp16", "topk:ratio=0.01,ef=true", "powersgd:rank=4,ef=true")]


def cheap(spec: str) -> KernelCost:
    """Memory-bound kernels (in proportion to the elements: 2 ms per 4M to compress, 1 ms to
    decompress, 0.1 ms more per further payload), the same for every compressor; none for ``none``."""
    if spec == "none":
        return FREE
    return KernelCost((1,), (2e-3 / 2**22,), (1e-3 / 2**22,), (1e-3 / 2**22,), (1e-4 / 2**22,))


def test_routes_per_aggregation() -> None:
    single = Cluster(4, LinkCosts(1e-5, 1e-9))
    nodes = Cluster(16, LinkCosts(1e-5, 1e-9), local_size=4, intra=LinkCosts(1e-6, 1e-11))
    assert [r for r, _, _ in plan.routes(method_of("topk:ratio=0.01"), single)] == ["all_gather", "two_phase"]
    across = [(r, ok, m.spec.local_size) for r, ok, m in plan.routes(method_of("topk:ratio=0.01"), nodes)]
    assert across == [("all_gather", True, 0), ("two_phase", True, 0), ("local_size=4", True, 4)]
    flat = {r: ok for r, ok, _ in plan.routes(method_of("fp16"), single)}
    assert flat == {"native": True, "ring": True, "tree": True, "halving_doubling": True, "in_network": False}
    assert {r for r, _, _ in plan.routes(method_of("fp16"), nodes)} == {*flat, "hierarchical", "local_size=4"}
    # every variant the rules allow is priced (the policy across nodes: planned), none they refuse
    assert "local_size=4" in {r for r, _, _ in plan.routes(method_of("fp16:vectors=dense"), nodes)}
    assert "two_phase" not in {r for r, _, _ in plan.routes(method_of("sign:ef=ef21"), single)}
    torch_fp16 = TorchHookSpec.parse("torch:fp16").cost_method()
    assert [r for r, _, _ in plan.routes(torch_fp16, nodes, torch_hook=True)] == ["native"]


def test_a_free_link_keeps_the_gradient_uncompressed() -> None:
    free_link = Cluster(8, LinkCosts(0.0, 0.0))
    found = plan.options(WORKLOAD, free_link, METHODS, cheap)
    choice, reason = plan.recommend(found)
    assert choice.method.label == "allreduce"
    assert "compression does not pay" in reason


def test_without_the_baseline_the_recommendation_says_so() -> None:
    slow = Cluster(8, LinkCosts(1e-4, 8e-8))
    found = plan.options(WORKLOAD, slow, [m for m in METHODS if m.label != "allreduce"], cheap)
    _, reason = plan.recommend(found)
    assert "allreduce is not among the candidates" in reason and "does not pay" not in reason


def test_a_dear_link_picks_a_compressor_and_says_why() -> None:
    slow = Cluster(8, LinkCosts(1e-4, 8e-8))  # 12.5 MB/s
    found = plan.options(WORKLOAD, slow, METHODS, cheap)
    choice, reason = plan.recommend(found)
    assert choice.method.label in ("topk:ratio=0.01,ef=true", "powersgd:rank=4,warm_start=true,ef=true")
    allreduce = plan.best(found, "allreduce")
    assert allreduce is not None and choice.step.step_s < allreduce.step.step_s / 5
    assert "faster per step than allreduce" in reason and "Lossy" in reason
    # the in-network option is priced but never recommended: no hook runs it
    assert any(o.route == "in_network" for o in found) and choice.available


def test_scaling_follows_each_methods_best_route() -> None:
    link = LinkCosts(2e-5, 1 / 3.125e9)
    curves = plan.scaling(WORKLOAD, lambda p: Cluster(p, link), METHODS, cheap, ranks=(2, 64, 4096))
    assert set(curves) == {m.label for m in METHODS}
    ring = curves["allreduce"]
    assert [p for p, _ in ring] == [2, 64, 4096]
    assert ring[0][1].step.step_s < ring[-1][1].step.step_s  # latency terms grow with p
    topk = dict(curves[METHODS[2].label])
    assert topk[4096].route == "two_phase"  # all-gathering 4095 payloads loses at that scale


def test_params_become_layers() -> None:
    assert layers(2048 * 2048 * 2 + 2048 * 3 + 5) == [(2048, 2048), (2048, 2048), (3, 2048), (5,)]
    assert sum(a * (b[0] if b else 1) for a, *b in layers(25_000_000)) == 25_000_000


def _profile(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A calibration profile with made-up kernels for every default candidate (nothing is timed)."""
    specs = [m.kernel_spec for m in METHODS] + [str(method_of(s).compressor) for s in plan.CANDIDATES]
    kernel = cheap("")
    profile = Profile("made-up", "1gbit", 2, {"all_reduce": LinkFit(LinkCosts(1e-4, 8e-9), 0, 0, 0)},
                      {s: kernel for s in specs if s})  # fmt: skip
    path = tmp_path / "profile.json"
    profile.save(path)
    return str(path)


def test_the_plan_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    calibration = _profile(tmp_path)
    out_json, out_html = tmp_path / "plan.json", tmp_path / "plan.html"
    code = cli.main(["plan", "--params", "25M", "--compute-ms", "150", "--ranks", "1024", "--nodes", "128x8",
                     "--net", "25gbit", "--intra", "600GB/s", "--calibration", calibration,
                     "--json", str(out_json), "--html", str(out_html)])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "Recommendation:" in text and "in_network" in text and "predicted only" in text
    figures = json.loads(out_json.read_text())
    assert figures["ranks"] == 1024 and figures["local_size"] == 8
    assert figures["inter"]["beta"] == pytest.approx(8 / 25e9)
    assert {o["method"] for o in figures["options"]} >= {"allreduce", "torch:allreduce", "torch:fp16"}
    assert max(p["ranks"] for p in figures["scaling"]["allreduce"]) == 4096
    page = out_html.read_text()
    assert page.count("<svg") == 2 and "<script" not in page and "http" not in page.replace("http://www.w3.org", "")


def test_a_calibrated_cluster_gives_the_link_inside_a_node(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A profile calibrated on an emulated cluster holds the link inside a node too: the plan prices
    the node's steps with it unless --intra says otherwise."""
    kernel = cheap("")
    inside = LinkFit(LinkCosts(3e-4, 1.4e-9), 0, 0, 0)
    links = {"all_reduce": LinkFit(LinkCosts(1e-3, 8e-8), 0, 0, 0), INSIDE + "all_reduce": inside}
    profile = Profile("cluster", "nodes=2x2,inter=100mbit", 4, links, {"none": kernel, "fp16": kernel})
    profile.save(tmp_path / "cluster.json")
    out = tmp_path / "plan.json"
    base = ["plan", "--params", "1M", "--compute-ms", "10", "--ranks", "4", "--nodes", "2x2", "--calibration",
            str(tmp_path / "cluster.json"), "--candidates", "fp16", "--json", str(out)]  # fmt: skip
    assert cli.main(base) == 0
    intra = json.loads(out.read_text())["intra"]
    assert (intra["alpha"], intra["beta"]) == (3e-4, 1.4e-9)
    assert "inside nodes 0.7 GB/s, 300.0 us" in capsys.readouterr().out
    assert cli.main([*base, "--intra", "10GB/s"]) == 0
    assert json.loads(out.read_text())["intra"]["beta"] == pytest.approx(1e-10)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--params", "25M", "--ranks", "8", "--net", "1gbit"], "needs --compute-ms"),
        (["--params", "25M", "--model", "mlp", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit"], "one of them"),
        (["--params", "25M", "--compute-ms", "1", "--ranks", "8"], "--net RATE"),
        (["--params", "25M", "--compute-ms", "1", "--ranks", "8", "--nodes", "3x2", "--net", "1gbit"], "is 6 ranks"),
        (
            ["--params", "25M", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit", "--intra", "1GB/s"],
            "give --nodes",
        ),
        (["--params", "25M", "--compute-ms", "1", "--ranks", "0", "--net", "1gbit"], "--ranks must be"),
        (["--params", "25M", "--compute-ms", "1", "--ranks", "8", "--net", "fast"], "bandwidth 'fast'"),
        (["--params", "25M", "--compute-ms", "-1", "--ranks", "8", "--net", "1gbit"], "--compute-ms must be a finite"),
        (["--params", "25M", "--compute-ms", "nan", "--ranks", "8", "--net", "1gbit"], "--compute-ms must be a finite"),
        (["--params", "25M", "--compute-ms", "inf", "--ranks", "8", "--net", "1gbit"], "--compute-ms must be a finite"),
        (
            ["--params", "1M", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit", "--candidates", "noop"],
            "noop sends nothing",
        ),
        (["--model", "nomodule:f", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit"], "cannot build"),
        (
            ["--params", "1M", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit", "--candidates", "zip"],
            "unknown compressor",
        ),
        (["--params", "1M", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit", "--device", "tpu"], "--device must"),
        (["--params", "1M", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit", "--nic", "node"], "give --nodes"),
    ],
)
def test_the_plan_command_refuses_impossible_inputs(arguments: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", *arguments])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_lossy_method_must_win_by_a_margin_and_a_close_runner_up_is_named() -> None:
    """3% faster than the uncompressed gradient is within the model's error, not worth an accuracy
    risk: the uncompressed gradient is recommended, saying why; a runner-up within 5% is named."""
    import dataclasses

    found = plan.options(WORKLOAD, Cluster(8, LinkCosts(1e-4, 8e-8)), METHODS, cheap)
    allreduce = plan.best(found, "allreduce")
    assert allreduce is not None
    topk = next(o for o in found if o.method.label.startswith("topk") and o.available)
    close = dataclasses.replace(topk, step=dataclasses.replace(topk.step, step_s=allreduce.step.step_s / 1.03))
    choice, reason = plan.recommend([allreduce, close])
    assert choice is allreduce, reason
    assert "is predicted 3% faster, less than the 10% a lossy method must win by" in reason
    assert "within 5%" in reason  # and the two may trade places
    clear = dataclasses.replace(topk, step=dataclasses.replace(topk.step, step_s=allreduce.step.step_s / 1.5))
    choice, reason = plan.recommend([allreduce, clear])
    assert choice is clear and "Lossy" in reason and "within" not in reason
