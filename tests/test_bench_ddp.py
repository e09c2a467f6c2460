"""``gradcomp bench ddp``: its arguments, its byte accounting against exact figures, a real 2-rank run."""

from __future__ import annotations

import io
import statistics
import sys
from pathlib import Path

import pytest
import torch

from gradcomp.bench.launches import gpt_shapes
from gradcomp.cli import main
from gradcomp.experiments.bench.command import split_hooks
from gradcomp.experiments.bench.modes import FSDP, NOOP, TORCH_ALLREDUCE
from gradcomp.experiments.bench.results import Row, combine
from gradcomp.experiments.bench.runner import failure, run, units
from gradcomp.experiments.bench.settings import BenchSettings
from gradcomp.experiments.bench.table import format_phases, format_table
from gradcomp.experiments.bench.workloads import PRESETS, user_model
from gradcomp.experiments.tasks import build_task
from gradcomp.launch import RankError
from gradcomp.progress import Progress

TORCH_FP16 = "torch:fp16"

MLP_GRADIENT_MB = 6_316_042 * 4 / 1e6


@pytest.mark.parametrize(
    ("text", "specs"),
    [
        ("fp16", ["fp16"]),
        ("fp16,topk:ratio=0.01,ef=true,powersgd:rank=4", ["fp16", "topk:ratio=0.01,ef=true", "powersgd:rank=4"]),
        ("allreduce;sign:ef=true; quantize:bits=4,seed=3", ["allreduce", "sign:ef=true", "quantize:bits=4,seed=3"]),
        ("noop,allreduce", ["noop", "allreduce"]),
        (" ; ", []),
    ],
)
def test_hook_lists_split_on_names_not_on_options(text: str, specs: list[str]) -> None:
    assert split_hooks(text) == specs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "vgg"}, "unknown model preset"),
        ({"ranks": 1}, "needs peers"),
        ({"specs": ("topq",)}, "unknown compressor"),
        ({"specs": ("fp16:algo=butterfly",)}, "unknown all-reduce algorithm"),
        ({"torch_hooks": ("torch:bf17",)}, "unknown torch hook"),
        ({"torch_hooks": ("bf16",)}, "starts with 'torch:'"),
        ({"specs": ("torch:powersgd:rank=0",)}, "rank must be >= 1"),
        ({"steps": 1, "rounds": 2}, "steps >= rounds"),
        ({"runs": 0}, "--runs must be >= 1"),
        ({"specs": ("quantize:bits=4,local_size=3",)}, "local_size=3 does not divide the 2 ranks into nodes"),
    ],
)
def test_bad_settings_fail_before_any_rank_starts(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"model": "mlp", "ranks": 2, "network": "loopback", "specs": ("fp16",)}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        BenchSettings(**arguments)  # type: ignore[arg-type]


def test_the_variants_are_the_anchors_then_torchs_then_each_spec_once() -> None:
    """A spec that repeats an earlier variant (in its canonical text) is measured once; torch's
    default hooks are the mode's own unless given."""
    specs = ("fp16", " fp16:algo=ring ", "torch:fp16", "allreduce", "sign:ef=true")
    ddp = BenchSettings("mlp", 2, "loopback", specs)
    assert ddp.variants == [NOOP, TORCH_ALLREDUCE, "torch:allreduce_hook", "torch:fp16", "torch:powersgd:rank=4",
                            "fp16", "fp16:algo=ring", "allreduce", "sign:ef=true"]  # fmt: skip
    fsdp = BenchSettings("mlp", 2, "loopback", ("none", "bf16"), mode=FSDP)
    assert fsdp.variants == [NOOP, "torch:reduce_scatter", "torch:bf16", "none", "bf16"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--backend", "mpi"], "--backend must be gloo or nccl"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
    ],
)
def test_the_device_and_backend_are_checked_before_any_rank_starts(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--hooks", "fp16", *arguments])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_cuda_is_refused_where_there_is_none(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--hooks", "fp16", "--device", "cuda"])
    assert "this machine has no CUDA device" in capsys.readouterr().err


def test_the_command_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--model", "vgg"])
    error = capsys.readouterr().err
    assert "--model takes a preset (mlp, cnn, transformer, gpt) or pkg.module:factory, got 'vgg'" in error


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("tests.bench_models:tiny", ""), "--input-shape must be positive sizes"),
        (("tests.bench_models:tiny", "3,x"), "--input-shape must be positive sizes"),
        (("tests.bench_models:tiny", "3,0"), "--input-shape must be positive sizes"),
        (("tests.no_such_module:tiny", "16"), "cannot import 'tests.no_such_module'"),
        (("tests.bench_models:absent", "16"), "has no function 'absent'"),
        (("tests.bench_models:NOT_A_MODEL", "16"), "has no function 'NOT_A_MODEL'"),
        (("tests.bench_models:", "16"), "pkg.module:factory"),
    ],
)
def test_a_users_model_is_checked_before_any_rank_starts(arguments: tuple[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        user_model(*arguments)


def test_a_users_model_needs_an_input_shape(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--model", "tests.bench_models:tiny"])
    assert "needs --input-shape" in capsys.readouterr().err


def test_a_factory_must_return_a_module() -> None:
    with pytest.raises(TypeError, match=r"returned a int, not a torch\.nn\.Module"):
        user_model("tests.bench_models:not_a_model", "16").build()


def test_a_users_models_train_on_random_inputs_of_their_shape() -> None:
    """Float inputs for a plain model, token ids for one that embeds them (and returns a tuple)."""
    floats = user_model("tests.bench_models:tiny", "16", batch_size=4)
    ids = user_model("tests.bench_models:tokens", "12", batch_size=3, input_high=50)
    rows = run(BenchSettings(floats, 2, "loopback", ("fp16",), (), steps=2, rounds=1, warmup=2, timeout=300, runs=2))
    assert [r.variant for r in rows] == [NOOP, TORCH_ALLREDUCE, "fp16"] and all(r.status == "ok" for r in rows)
    assert all(len(r.run_ms) == 2 and len(r.step_ms) == 4 for r in rows)  # two runs of two timed steps
    assert rows[-1].wire_mb_per_step == pytest.approx((16 * 32 + 32 + 32 * 4 + 4) * 2 / 1e6)
    batch = ids.batch(rank=1, seed=0)
    assert batch.shape == (3, 12) and batch.dtype == torch.int64 and 0 <= int(batch.min()) <= int(batch.max()) < 50
    rows = run(BenchSettings(ids, 2, "loopback", ("bf16",), (), steps=2, rounds=1, warmup=2, timeout=300))
    assert all(r.status == "ok" for r in rows)


def test_torch_powersgd_runs_alone_and_its_bytes_are_its_factors_and_vectors() -> None:
    """The tiny model is one bucket: torch's PowerSGD runs. Rank 1 sends, per step, the factors of the
    32x16 weight (32 + 16) and the 4x32 one (4 + 32), and both biases whole (32 + 4): 120 floats."""
    model = user_model("tests.bench_models:tiny", "16", batch_size=4)
    settings = BenchSettings(model, 2, "loopback", ("torch:powersgd:rank=1",), (), steps=2, rounds=1, warmup=2,
                             timeout=300)  # fmt: skip
    terminal = io.StringIO()
    with Progress("bench ddp", units(settings), stream=terminal, enabled=True, tick=0, columns=200) as progress:
        rows = run(settings, progress)
    # The parent says what each launch of ranks measures: the variants in rounds, then PowerSGD alone.
    lines = [line for line in terminal.getvalue().split("\r\x1b[K") if line]
    assert lines[0].startswith("bench ddp  0/3  loopback: 2 variants in rounds (noop, torch:allreduce)  elapsed ")
    assert lines[1].startswith("bench ddp  2/3  loopback: 2 variants in rounds") and "ETA" in lines[1]
    assert lines[2].startswith("bench ddp  2/3  loopback: torch:powersgd:rank=1 (alone)  elapsed ")
    assert lines[-1].startswith("bench ddp  3/3  ") and lines[-1].endswith("ETA 0:00")
    assert terminal.getvalue().endswith("\r\x1b[K")  # the line is taken away at the end
    assert [r.variant for r in rows] == [NOOP, TORCH_ALLREDUCE, "torch:powersgd:rank=1"]
    assert all(r.status == "ok" for r in rows)
    assert rows[-1].wire_mb_per_step == pytest.approx(120 * 4 / 1e6)
    assert rows[1].wire_mb_per_step == pytest.approx((16 * 32 + 32 + 32 * 4 + 4) * 4 / 1e6)


def test_a_real_run_measures_every_variant_and_counts_bytes_exactly() -> None:
    specs = ("allreduce", "fp16", "topk:ratio=0.01,ef=true")
    rows = run(BenchSettings("mlp", 2, "loopback", specs, (TORCH_FP16,), steps=4, rounds=2, warmup=2, timeout=300))
    assert [r.variant for r in rows] == [NOOP, TORCH_ALLREDUCE, TORCH_FP16, *specs]
    wire = {r.variant: r.wire_mb_per_step for r in rows}
    for row in rows:
        assert row.status == "ok"
        assert len(row.step_ms) == 4 and min(row.step_ms) > 0
        assert row.ms_per_step == pytest.approx(statistics.median(row.step_ms))
    # At two ranks a ring sends 2 (p - 1) / p = 1 x the payload: all the gradients, or half in fp16.
    assert wire[NOOP] == 0
    assert wire[TORCH_ALLREDUCE] == pytest.approx(MLP_GRADIENT_MB)
    assert wire["allreduce"] == pytest.approx(MLP_GRADIENT_MB)
    assert wire[TORCH_FP16] == pytest.approx(MLP_GRADIENT_MB / 2)
    assert wire["fp16"] == pytest.approx(MLP_GRADIENT_MB / 2)
    # top-k 1% as values and indices, gathered (measured by gradcomp's own all-gather): a few %
    assert 0.01 * MLP_GRADIENT_MB < wire["topk:ratio=0.01,ef=true"] < 0.05 * MLP_GRADIENT_MB
    cells = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in format_table(rows).splitlines()}
    assert cells["torch:allreduce"] == "1.00x"  # its speedup over itself
    # The engine's phases, for gradcomp's hooks only: top-k compresses and decompresses, every hook
    # communicates, and the tail (what backward could not hide) is within the step.
    phases = {r.variant: r.phases_ms for r in rows}
    assert phases[NOOP] is None and phases[TORCH_ALLREDUCE] is None and phases[TORCH_FP16] is None
    topk = phases["topk:ratio=0.01,ef=true"]
    assert topk is not None and topk["compress"] > 0 and topk["decompress"] > 0 and topk["communicate"] > 0
    for spec in specs:
        figures = phases[spec]
        assert figures is not None and 0 <= figures["tail"] <= max(r.ms_per_step or 0 for r in rows)
    table = format_phases(rows).splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == list(specs)
    # Each gradcomp hook's kernels timed alone on the step's gradients; none for torch's or the floor.
    alone = {r.variant: r.kernels_ms for r in rows}
    assert alone[NOOP] is None and alone[TORCH_ALLREDUCE] is None and alone[TORCH_FP16] is None
    assert all(alone[spec] and alone[spec] > 0 for spec in specs)
    assert alone["topk:ratio=0.01,ef=true"] > alone["fp16"]  # a selection costs more than a cast


@pytest.mark.parametrize("preset", ["transformer", "cnn", "gpt"])
def test_every_preset_trains_on_inputs_made_for_its_model(preset: str) -> None:
    """Token ids for the transformer, images for ResNet-18: the task makes them when the model is built."""
    rows = run(BenchSettings(preset, 2, "loopback", ("fp16",), (), steps=2, rounds=1, warmup=2, timeout=300))
    assert all(r.status == "ok" and r.ms_per_step for r in rows)


def test_the_gpt_preset_has_the_many_small_tensors_of_the_models_people_train() -> None:
    model = build_task("synthetic").build_model(PRESETS["gpt"].model)
    tensors = [p for p in model.parameters() if p.requires_grad]
    assert len(tensors) == len(gpt_shapes()) == 150 and sum(p.dim() == 1 for p in tensors) == 99  # biases, norms


def test_failures_are_reported_as_hung_or_aborted() -> None:
    hung = failure(RankError("ranks [0, 1] of 2 did not finish within 70 s"), 70.0)
    assert hung == "hung (killed after 70 s)"
    traceback = "rank 1 of 2 failed:\nTraceback (most recent call last):\n  File x\nRuntimeError: Received data size"
    assert failure(RankError(traceback), 70.0) == "aborted: RuntimeError: Received data size"
    reason = "ValueError: torch's PowerSGD hook hangs on gloo when DDP splits the gradients" + " (why)" * 30
    assert failure(RankError(f"rank 0 of 2 failed:\n{reason}"), 70.0) == f"aborted: {reason}"  # a note holds it


def test_a_failed_variant_has_a_row_without_figures() -> None:
    rows = [
        Row(NOOP, "loopback", 30.0, 0.0),
        Row(TORCH_ALLREDUCE, "loopback", 60.0, 25.3),
        Row("torch:powersgd:rank=4", "loopback", None, None, "hung (killed after 70 s)"),
        Row("powersgd:rank=4", "loopback", 40.0, 0.16),
    ]
    table, notes = format_table(rows).split("\n\n")
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    assert lines[4] == ["torch:powersgd:rank=4", "-", "-", "-", "-", "hung [1]"]
    assert lines[5] == ["powersgd:rank=4", "40.0", "1.50x", "1.33", "0.16", "ok"]
    assert notes == "[1] torch:powersgd:rank=4: hung (killed after 70 s)"


def test_a_refusal_is_a_short_cell_and_a_footnote() -> None:
    """torch's PowerSGD refused on gloo used to fill its cell with the whole exception line (over 100
    columns): the cell says what happened, a note below the table why; the same reason twice is one note."""
    refusal = ("aborted: ValueError: torch's powerSGD_hook issues collectives from a future's callback: on gloo "
               "with several buckets it would hang; use gradcomp's powersgd")  # fmt: skip
    rows = [
        Row(NOOP, "loopback", 30.0, 0.0),
        Row(TORCH_ALLREDUCE, "loopback", 60.0, 25.3),
        Row("torch:powersgd:rank=4", "loopback", None, None, refusal),
        Row("torch:powersgd:rank=1", "loopback", None, None, refusal),
        combine([Row("fp16", "loopback", 40.0, 1.0, "ok", [40.0], None, [40.0]),
                 Row("fp16", "loopback", None, None, "hung (killed after 70 s)", run_ms=[None])]),
    ]  # fmt: skip
    table, notes = format_table(rows).split("\n\n")
    status = [line.strip("|").split("|")[-1].strip() for line in table.splitlines()[2:]]
    assert max(len(line) for line in table.splitlines()) < 120 and max(map(len, status)) < 24
    assert status == ["ok", "ok", "aborted [1]", "aborted [1]", "ok in 1 of 2 runs [2]"]
    assert notes.splitlines() == [
        f"[1] torch:powersgd:rank=4, torch:powersgd:rank=1: {refusal}",
        "[2] fp16: ok in 1 of 2 runs; hung (killed after 70 s)",
    ]


def test_runs_combine_into_medians_with_the_range_of_each_runs_ratio() -> None:
    """Three runs: the figures are medians over them, and each ratio's range pairs every run with
    its own anchor (a run whose floor moved moves its ratios, not the others')."""
    runs = [
        {NOOP: 20.0, TORCH_ALLREDUCE: 40.0, "fp16": 30.0},
        {NOOP: 25.0, TORCH_ALLREDUCE: 40.0, "fp16": 35.0},
        {NOOP: 22.0, TORCH_ALLREDUCE: 44.0, "fp16": 33.0},
    ]
    phases = {"compress": 1.0, "decompress": 2.0, "communicate": 3.0, "tail": 4.0}
    combined = [
        combine(
            [Row(v, "loopback", run[v], 1.0, "ok", [run[v]], phases if v == "fp16" else None, [run[v]]) for run in runs]
        )
        for v in (NOOP, TORCH_ALLREDUCE, "fp16")
    ]
    assert [r.ms_per_step for r in combined] == [22.0, 40.0, 33.0]
    assert combined[2].run_ms == [30.0, 35.0, 33.0] and combined[2].step_ms == [30.0, 35.0, 33.0]
    assert combined[2].phases_ms == phases
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in format_table(combined).splitlines()]
    # fp16: 40/30, 40/35, 44/33 -> median 1.33x of 1.14-1.33x; x floor: 30/20, 35/25, 33/22 -> 1.50 of 1.40-1.50
    assert lines[4] == ["fp16", "33.0", "1.33x (1.14-1.33)", "1.50 (1.40-1.50)", "1.00", "ok"]
    assert lines[2][2:4] == ["2.00x (1.60-2.00)", "1.00"] and lines[3][2:4] == ["1.00x", "2.00 (1.60-2.00)"]


def test_a_variant_that_failed_in_some_runs_says_so() -> None:
    failed = Row("torch:powersgd:rank=4", "1gbit", None, None, "hung (killed after 70 s)", run_ms=[None])
    ok = Row("torch:powersgd:rank=4", "1gbit", 50.0, 0.6, "ok", [50.0], None, [50.0])
    row = combine([failed, ok])
    assert row.ms_per_step == 50.0 and row.run_ms == [None, 50.0]
    assert row.status == "ok in 1 of 2 runs; hung (killed after 70 s)"
    assert combine([failed, failed]).ms_per_step is None
    # its ratios pair it with the anchors of the run where it completed, not with their medians
    noop = combine([Row(NOOP, "1gbit", t, 0.0, "ok", [t], None, [t]) for t in (20.0, 30.0)])
    anchor = combine([Row(TORCH_ALLREDUCE, "1gbit", t, 25.0, "ok", [t], None, [t]) for t in (40.0, 60.0)])
    lines = [line.split("|")[2:5] for line in format_table([noop, anchor, row]).split("\n\n")[0].splitlines()]
    assert [cell.strip() for cell in lines[4]] == ["50.0", "1.20x", "1.67"]  # 60 / 50 and 50 / 30


def test_the_command_finds_a_model_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `python -m` would: a console script does not put the current directory on sys.path itself."""
    (tmp_path / "my_models.py").write_text("from torch import nn\n\ndef small():\n    return nn.Linear(4, 2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    arguments = ["--input-shape", "4", "--hooks", "fp16", "--torch-hooks", "none", "--steps", "2", "--rounds", "1"]
    assert main(["bench", "ddp", "--model", "my_models:small", *arguments, "--warmup", "2"]) == 0
    printed = capsys.readouterr()
    assert "my_models:small, random inputs of shape [4]" in printed.out
    assert printed.err == ""  # stderr is no terminal here: no progress line


def test_bench_fsdp_measures_fsdp2s_own_beside_gradcomps_reduce_scatter() -> None:
    """``gradcomp bench fsdp``: FSDP2's reduce-scatter is the anchor; at 2 ranks it sends half of the
    tiny model's gradients (676 floats, no padding at 2 ranks), bf16 half of that; gradcomp's
    uncompressed reduce-scatter sends the same, its 4-bit codes (measured) less."""
    model = user_model("tests.bench_models:tiny", "16", batch_size=4)
    specs = ("none", "quantize:bits=4,ef=true")
    rows = run(BenchSettings(model, 2, "loopback", specs, ("torch:bf16",), steps=2, rounds=1, warmup=2, timeout=300,
                             mode=FSDP))  # fmt: skip
    assert [r.variant for r in rows] == [NOOP, "torch:reduce_scatter", "torch:bf16", *specs]
    assert all(r.status == "ok" for r in rows), [r.status for r in rows]
    wire = {r.variant: r.wire_mb_per_step for r in rows}
    assert wire["torch:reduce_scatter"] == wire["none"] == pytest.approx(676 / 2 * 4 / 1e6)
    assert wire["torch:bf16"] == pytest.approx(676 / 2 * 2 / 1e6)
    assert 0 < wire["quantize:bits=4,ef=true"] < wire["torch:bf16"]
    assert "speedup vs torch:reduce_scatter" in format_table(rows, FSDP.anchor)
    phases = {r.variant: r.phases_ms for r in rows}
    assert phases["torch:reduce_scatter"] is None and phases["quantize:bits=4,ef=true"] is not None
    with pytest.raises(ValueError, match="unknown FSDP2 reduction"):
        BenchSettings(model, 2, "loopback", specs, ("torch:fp16x",), mode=FSDP)
    with pytest.raises(ValueError, match="needs each tensor's shape"):
        BenchSettings(model, 2, "loopback", ("powersgd:rank=2",), (), mode=FSDP)
