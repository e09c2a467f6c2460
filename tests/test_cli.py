"""The `gradcomp` command: listing, the compressor benchmark end to end, and clear refusals."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest

from gradcomp.bench.compressors import DEFAULT_SPECS, Row, format_table, run
from gradcomp.cli import main
from gradcomp.compressors import REGISTRY
from gradcomp.progress import Progress, clock


def test_lists_every_compressor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compressors"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert name in out
    assert "ratio=0.01 (float)" in out and "ef" in out


class Terminal(io.StringIO):
    """A stream that says it is a terminal: where a command shows its progress."""

    def isatty(self) -> bool:
        return True


def drawn(terminal: io.StringIO) -> list[str]:
    """The status lines drawn on ``terminal``, in order (each starts by taking the last away)."""
    return [line for line in terminal.getvalue().split("\r\x1b[K") if line]


def test_the_listing_names_every_hook_name_and_option(capsys: pytest.CaptureFixture[str]) -> None:
    """What a hook spec takes besides a compressor's: the hooks' own names (auto, torch's) and the
    engine's options, which the listing once left out."""
    from importlib.metadata import entry_points

    from gradcomp.engine import spec

    assert main(["compressors"]) == 0
    out = capsys.readouterr().out
    section = out.split("is a compressor spec or one of:\n")[1].split("\n\n")[0]
    names = [line.split()[0] for line in section.splitlines()]
    torch_names = ["torch:allreduce", "torch:allreduce_hook", "torch:fp16", "torch:bf16", "torch:powersgd"]
    assert names == ["allreduce", "noop", "auto", *torch_names]
    assert set(names) | set(REGISTRY) == set(spec.valid_names())
    for option in spec.ENGINE_OPTIONS:
        assert f"\n  {option}=" in out
    assert "algo=native (native | ring | tree | halving_doubling)" in out
    assert "also takes:\n  torch:reduce_scatter " in out  # a sharded run's: FSDP2's own reductions
    # a process that never imported the hooks (the command's) finds them through the installed entry point
    assert "gradcomp.hooks" in {entry.value for entry in entry_points(group=spec.KINDS_GROUP)}


def test_the_listing_takes_a_plugin_compressor_without_a_docstring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradcomp.compressors.topk import TopK

    undocumented = type("Undocumented", (TopK,), {"name": "undocumented"})  # a class's docstring is not inherited
    assert undocumented.__doc__ is None
    monkeypatch.setitem(REGISTRY, "undocumented", undocumented)
    assert main(["compressors"]) == 0
    assert "undocumented gather -\n" in capsys.readouterr().out


def test_bench_compressors_writes_a_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "bench.json"
    specs = "fp16;topk:ratio=0.1;powersgd:rank=2"
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert (
        main(["bench", "compressors", "--sizes", "4096,10K", "--repeats", "2", "--specs", specs, "--json", str(report)])
        == 0
    )
    out = capsys.readouterr().out
    # On a terminal: what is timed, n of N, the time so far, then the rest; the line gone at the end.
    lines = drawn(terminal)
    assert lines[0].startswith("bench compressors  0/8  4096 elements: fp16 cast and torch.topk  elapsed 0:0")
    assert any(line.startswith("bench compressors  6/8  10K elements: topk:ratio=0.1") for line in lines)
    assert all("ETA" in line for line in lines[1:]) and lines[-1].startswith("bench compressors  8/8  ")
    assert terminal.getvalue().endswith("\r\x1b[K") and "\r" not in out and "elapsed" not in out
    assert "| `fp16` " in out and "topk:ratio=0.1" in out
    data = json.loads(report.read_text())
    assert data["machine"]["threads"] == 1
    assert [r["numel"] for r in data["references"]] == [4096, 10_000]
    rows = data["rows"]
    assert len(rows) == 6
    for row in rows:
        assert row["compress_ms"] > 0 and row["floor_ms"] > 0
        assert row["vs_floor"] == pytest.approx(row["total_ms"] / row["floor_ms"])
    fp16 = next(r for r in rows if r["spec"] == "fp16" and r["numel"] == 4096)
    assert fp16["wire_bytes"] == 2 * 4096 and fp16["ratio"] == 2.0
    powersgd = next(r for r in rows if r["spec"].startswith("powersgd") and r["numel"] == 4096)
    assert powersgd["wire_bytes"] == 4 * 2 * (64 + 64)  # 4096 elements are a 64 x 64 matrix
    # operators per bucket: each spec, and with error feedback; a cast takes any bucket as one run
    counted = {entry["spec"]: entry for entry in data["launches"]}
    assert set(counted) >= {"fp16", "fp16:ef=true", "topk:ratio=0.1,method=exact,tolerance=0.2,ef=true"}
    assert counted["fp16"]["one"]["compress"] == counted["fp16"]["many"]["compress"] > 0
    assert counted["fp16"]["many"]["tensors"] == 150 and "| `fp16` " in out.split("Operators per bucket")[1]


def test_default_specs_all_parse_and_run_on_a_small_tensor() -> None:
    references, rows = run([1000], DEFAULT_SPECS, repeats=1)
    assert {r.spec.split(":")[0] for r in rows} == set(REGISTRY)
    assert format_table(references, rows).splitlines()[4].startswith("| compressor ")
    assert all(isinstance(r, Row) and r.wire_bytes > 0 for r in rows)


def test_bad_arguments_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "compressors", "--specs", "topq", "--sizes", "10"])
    assert exit_info.value.code == 2
    assert "unknown compressor 'topq'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "compressors", "--threads", "0"])
    # refused before the calibration's minutes of measurements, not after them
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "-o", "/nonexistent/dir/profile.json"])
    assert exit_info.value.code == 2
    assert "cannot write /nonexistent/dir/profile.json: no directory /nonexistent/dir" in capsys.readouterr().err


def test_bench_collectives_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "collectives.json"
    argv = ["bench", "collectives", "--ranks", "2", "--sizes", "4KiB,64K", "--algos", "ring,tree"]
    assert main([*argv, "--repeats", "2", "--json", str(report)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # stderr is no terminal (a pipe, a log): no progress
    cells = [[c.strip() for c in line.split("|")[1:3]] for line in printed.out.splitlines() if "|" in line]
    assert ["250 KiB", "native"] in cells and ["4 KiB", "tree"] in cells  # 64K float32 = 256,000 bytes
    data = json.loads(report.read_text())
    assert data["ranks"] == 2 and data["networks"] == ["loopback"]
    rows = data["rows"]
    assert {(r["algo"], r["size_bytes"]) for r in rows} == {
        (a, s)
        for a in ("native", "ring", "tree")
        for s in (4096, 64_000 * 4)  # 64K elements: float32
    }
    for row in rows:
        assert row["time_ms"] > 0
        assert row["busbw"] == pytest.approx(row["algbw"])  # 2 (p - 1) / p = 1 at two ranks
        assert row["vs_native"] == pytest.approx(row["native_time_ms"] / row["time_ms"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algos", "butterfly"], "unknown algorithm"),
        (["--sizes", "6B"], "multiples of 4 bytes"),
        (["--sizes", "4XB"], "is not one of: N, NK"),
        (["--sizes", "4Mi"], "is not one of: N, NK"),
        (["--ranks", "3", "--algos", "hierarchical", "--local-size", "2"], "does not divide"),
        (["--net", "loopback,fast"], "bad rate"),
        (["--net", ","], "at least one network"),
    ],
)
def test_bench_collectives_refuses_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "collectives", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--ranks", "2", "--net", "1gbit", "--model", "mlp", "--candidates", "fp16;topk:ratio=2"],
        ["bench", "ddp", "--ranks", "2", "--hooks", "fp16;topk:ratio=2"],
        ["bench", "compressors", "--specs", "fp16;topk:ratio=2", "--sizes", "1K"],
    ],
)
def test_a_bad_spec_in_a_list_is_named_as_typed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A list of specs may hold several of one compressor: the error names the one typed, not only
    its compressor (and before anything is measured)."""
    with pytest.raises(SystemExit):
        main(argv)
    assert "'topk:ratio=2': invalid options for 'topk': ratio must be in (0, 1], got 2.0" in capsys.readouterr().err


def test_progress_says_what_runs_how_far_and_when_it_ends() -> None:
    """One line, redrawn in place: the command, units done of all, the unit running, the time so far,
    and the rest estimated from the units done (the estimate made when the last ended, counted down)."""
    now = [100.0]
    terminal = Terminal()
    progress = Progress("bench ddp", 10, stream=terminal, tick=0, now=lambda: now[0], columns=200)
    with progress.step("loopback: 8 variants in rounds", 8):
        assert progress.line() == "bench ddp  0/10  loopback: 8 variants in rounds  elapsed 0:00"
        now[0] += 40
    assert progress.line().endswith("elapsed 0:40  ETA 0:10")  # 8 units in 40 s: 2 more take 10 s
    now[0] += 4
    with progress.step("loopback: torch:powersgd:rank=4 (alone)", 2):
        assert progress.line() == ("bench ddp  8/10  loopback: torch:powersgd:rank=4 (alone)  elapsed 0:44  ETA 0:06")
        now[0] += 3600
    assert progress.remaining() == 0 and progress.line().endswith("elapsed 1:00:44  ETA 0:00")
    progress.write("| table |\n", terminal)  # a command's output: the line out of its way, then back
    progress.close()
    assert drawn(terminal)[-2:] == ["| table |\n", progress.line()]
    assert terminal.getvalue().endswith("\r\x1b[K")


def test_progress_is_silent_where_stderr_is_no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, out = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with Progress("calibrate", 3, tick=0.001) as progress:
        assert not progress.enabled
        with progress.step("loopback: all-reduce and all-gather at 6 sizes"):
            time.sleep(0.01)
        progress.write("profile loopback-2ranks\n", out)
    assert pipe.getvalue() == "" and out.getvalue() == "profile loopback-2ranks\n"


def test_progress_never_wraps_and_shows_durations_as_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "70")
    terminal = Terminal()
    with Progress("bench collectives", 2, stream=terminal, tick=0) as progress, progress.step("x" * 100):
        pass
    assert drawn(terminal) and all(len(line) <= 69 for line in drawn(terminal))
    # a long label is cut short, never the counts and times
    assert drawn(terminal)[-1] == "bench collectives  1/2  " + "x" * 18 + "...  elapsed 0:00  ETA 0:00"
    assert [clock(s) for s in (0.4, 7, 61, 3599.6, 3723)] == ["0:00", "0:07", "1:01", "1:00:00", "1:02:03"]
