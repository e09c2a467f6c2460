"""The planner: routes per method, the recommendation where the link is free or dear, scaling, the command."""

from __future__ import annotations

import html
import io
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
    # the step falls from one node (8 ranks) to two: the table's note says why, on every output
    (note,) = figures["scaling_notes"]
    assert note.startswith("Up to 8 ranks the cluster is one node") and note in text
    assert html.escape(note) in page


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


@pytest.mark.parametrize("option", ["--json", "--html"])
def test_the_plan_command_refuses_an_output_it_cannot_write_before_computing(  # type: ignore[no-untyped-def]
    option, tmp_path, monkeypatch, capsys
) -> None:
    """Issue 48, item 8: a missing directory is one line, up front (the table is not computed)."""
    from gradcomp.experiments.plan import command

    monkeypatch.setattr(command, "setting", lambda args: pytest.fail("the table was computed"))
    missing = tmp_path / "missing" / "plan.out"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--params", "1M", "--compute-ms", "1", "--ranks", "8", "--net", "1gbit",
                  option, str(missing)])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot write {missing}: no directory" in err and err.count("\n") == 1


def test_a_lossy_method_must_win_by_a_margin_and_a_close_runner_up_is_named() -> None:
    """3% faster than the uncompressed gradient is within the model's error, not worth an accuracy
    risk: the uncompressed gradient is recommended, saying why; a runner-up within 5% of a choice is named."""
    import dataclasses

    found = plan.options(WORKLOAD, Cluster(8, LinkCosts(1e-4, 8e-8)), METHODS, cheap)
    allreduce = plan.best(found, "allreduce")
    assert allreduce is not None
    topk = next(o for o in found if o.method.label.startswith("topk") and o.available)
    close = dataclasses.replace(topk, step=dataclasses.replace(topk.step, step_s=allreduce.step.step_s / 1.03))
    choice, reason = plan.recommend([allreduce, close])
    assert choice is allreduce, reason
    assert "is predicted 3.0% faster (" in reason and "less than the 10% a lossy method must win by" in reason
    assert "within 5%" not in reason, "the method passed over is said once, with its figures"
    clear = dataclasses.replace(topk, step=dataclasses.replace(topk.step, step_s=allreduce.step.step_s / 1.5))
    choice, reason = plan.recommend([allreduce, clear])
    assert choice is clear and "Lossy" in reason and "within" not in reason
    powersgd = next(o for o in found if o.method.label.startswith("powersgd") and o.available)
    second = dataclasses.replace(powersgd, step=dataclasses.replace(powersgd.step, step_s=clear.step.step_s * 1.02))
    choice, reason = plan.recommend([allreduce, clear, second])
    assert choice is clear and "within 5%" in reason  # and the two may trade places


def test_a_predicted_tie_recommends_the_baseline_and_every_figure_is_the_tables() -> None:
    """fp16 predicted 1.00x the uncompressed all-reduce (0.3% faster) is no recommendation: the
    baseline is, saying by how much fp16 fell short of the 5% margin. fp16 clearly ahead is, with its
    bytes as the table has them (no "half the bytes" where the route sends more than half)."""
    import dataclasses

    nodes = Cluster(16, LinkCosts(1e-4, 8e-9), local_size=8, intra=LinkCosts(1e-6, 1e-11))
    found = plan.options(WORKLOAD, nodes, METHODS, cheap)
    allreduce = plan.best(found, "allreduce")
    assert allreduce is not None
    fp16 = next(o for o in found if o.method.label == "fp16" and o.route == "local_size=8")
    tie = dataclasses.replace(fp16, step=dataclasses.replace(fp16.step, step_s=allreduce.step.step_s / 1.003))
    choice, reason = plan.recommend([allreduce, tie])
    assert choice is allreduce, reason
    assert "1.00x" not in reason and "Nothing is predicted measurably faster than the uncompressed gradient" in reason
    assert f"fp16 over local_size=8 is predicted 0.3% faster ({tie.step.step_s * 1e3:.1f} ms against" in reason
    assert "less than the 5% a method must win by" in reason
    ahead = dataclasses.replace(fp16, step=dataclasses.replace(fp16.step, step_s=allreduce.step.step_s / 1.2))
    choice, reason = plan.recommend([allreduce, ahead])
    assert choice is ahead and "1.20x faster per step than allreduce" in reason
    sent, base = ahead.step.sent_bytes / 1e6, allreduce.step.sent_bytes / 1e6
    assert sent > base / 2, "across nodes the cast does not halve what a rank sends"
    assert f"{sent:.2f} MB sent per rank against allreduce's {base:.2f} MB ({sent / base:.0%} of its bytes" in reason
    assert "half the bytes" not in reason and "only what crosses nodes is cast" in reason


def test_a_step_that_falls_at_the_node_boundary_is_explained_from_the_scaling_table() -> None:
    """Up to 8 ranks (one node) a method averages the whole gradient; from 16 the hook across nodes
    averages an eighth: the step falls, and the note says so with the table's own figures."""
    link, intra = LinkCosts(2e-5, 1 / 3.125e9), LinkCosts(2e-6, 1 / 600e9)
    ranks = (2, 4, 8, 16, 32)
    curves = plan.scaling(WORKLOAD, lambda p: Cluster(p, link, min(8, p), intra), METHODS, cheap, ranks)
    fp16 = dict(curves["fp16"])
    assert fp16[16].step.step_s < 0.95 * fp16[8].step.step_s and fp16[16].route == "local_size=8"
    (note,) = plan.scaling_notes(curves, 8)
    assert note.startswith("Up to 8 ranks the cluster is one node") and "from 8 to 16 ranks the step falls" in note
    assert f"fp16 from {fp16[8].step.step_s * 1e3:.0f} to {fp16[16].step.step_s * 1e3:.0f} ms" in note
    kernels = [(fp16[p].step.compress_s + fp16[p].step.decompress_s) * 1e3 for p in (8, 16)]
    assert f"(its kernels from {kernels[0]:.1f} to {kernels[1]:.1f} ms)" in note
    # on one flat link nothing falls as ranks grow: nothing to explain
    assert plan.scaling_notes(plan.scaling(WORKLOAD, lambda p: Cluster(p, link), METHODS, cheap, ranks), 1) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_plan_shows_progress_on_a_terminal_only(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What runs and how far on a terminal's stderr (the kernels one by one, then each world size);
    nothing in a pipe or with --json, and stdout the same either way."""
    arguments = ["plan", "--params", "1M", "--compute-ms", "10", "--ranks", "16", "--nodes", "2x8", "--net", "1gbit",
                 "--calibration", _profile(tmp_path), "--candidates", "allreduce;fp16"]  # fmt: skip
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert cli.main(arguments) == 0
    shown = terminal.getvalue()
    assert "plan  1/" in shown and "reading kernels 1/2: none" in shown and "scaling: 4096 ranks" in shown
    assert f"{2 + 1 + len(plan.SCALING_RANKS)}/{2 + 1 + len(plan.SCALING_RANKS)}" in shown  # every unit, counted
    quiet = _Terminal()
    monkeypatch.setattr("sys.stderr", quiet)
    assert cli.main([*arguments, "--json", str(tmp_path / "plan.json")]) == 0
    assert quiet.getvalue() == ""
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert cli.main(arguments) == 0
    piped = capsys.readouterr()
    assert piped.err == "" and piped.out.split("Recommendation:")[1] == out.split("Recommendation:")[-1]
