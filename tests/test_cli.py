"""The `gradcomp` command: listing, the compressor benchmark end to end, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradcomp.bench.compressors import DEFAULT_SPECS, Row, format_table, run
from gradcomp.cli import main
from gradcomp.compressors import REGISTRY


def test_lists_every_compressor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compressors"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert name in out
    assert "ratio=0.01 (float)" in out and "ef" in out


def test_bench_compressors_writes_a_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "bench.json"
    specs = "fp16;topk:ratio=0.1;powersgd:rank=2"
    assert (
        main(["bench", "compressors", "--sizes", "4096,10K", "--repeats", "2", "--specs", specs, "--json", str(report)])
        == 0
    )
    out = capsys.readouterr().out
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
    cells = [[c.strip() for c in line.split("|")[1:3]] for line in capsys.readouterr().out.splitlines() if "|" in line]
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
