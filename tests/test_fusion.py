"""Fused kernels (``gradcomp.compressors.fusion``): compiled by Inductor, they give bitwise what the
eager operators give, for whole tensors and for a part's rows, at every dtype and at the extremes the
codec prescales, and DDP training on two gloo ranks with them compiled inside its hooks is bitwise
the eager training; a configuration compiles once and a new number of rows recompiles nothing; a
kernel that cannot compile warns once and leaves the eager operators to run; ``GRADCOMP_COMPILE`` is
checked; the roofline counts a fused kernel as one launch.

The only tests of the suite that compile (``tests/conftest.py`` sets ``GRADCOMP_COMPILE=0`` for the
rest): each configuration here costs seconds the first time, then Inductor's on-disk cache serves it."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from gradcomp.compressors import Segments, affine, fp8, fusion, make_compressor, sign
from gradcomp.compressors.base import Compressor
from tests.distributed import Failures, run_checks

needs_compiler = pytest.mark.skipif(
    not fusion.compiler_found(torch.device("cpu")), reason="Inductor needs a C++ compiler on the CPU"
)


def _gradient(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian values, one chunk of zeros, one of values near 1e-30 (a step below 2**-64: the
    prescaled map), one spanning +-1e38 (past 2**126 in float32; float32 and wider only)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x[1024:2048] = 0
    x[2048:3072] *= 1e-30
    if dtype in (torch.float32, torch.float64):
        x[3072:4096] = torch.linspace(-1e38, 1e38, 1024, dtype=torch.float64)
    return x.to(dtype)


def _round_trip(spec: str, x: torch.Tensor, setting: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """(payload..., decoded) of two steps of ``spec`` on ``x`` under ``GRADCOMP_COMPILE=setting``."""
    monkeypatch.setenv(fusion.ENVIRONMENT, setting)
    compressor = make_compressor(spec, seed=3)
    results: list[torch.Tensor] = []
    for _ in range(2):  # the second step draws other noise
        payload, ctx = compressor.compress(x, key="w")
        results += [t.clone() for t in payload]
        results.append(compressor.decompress(payload, ctx).clone())
    return tuple(results)


def _compiled_runs() -> int:
    """Calls of the encoding and decoding kernels that ran compiled (the min-max and hash kernels aside)."""
    kernels = (affine._ENCODE, affine._DECODE, sign._NEGATIVE, fp8._ENCODE, fp8._DECODE)
    return sum(kernel.compiled_runs for kernel in kernels)


SPECS = [
    ("quantize:bits=4", torch.float32),  # stochastic, min-max: a base per chunk
    ("quantize:bits=8,rounding=nearest", torch.float64),  # 255 levels, float64 arithmetic
    ("qsgd", torch.float16),  # symmetric: no base, a zero level
    ("terngrad:chunk=256", torch.bfloat16),
    ("sign", torch.float32),  # its codes kernel, the codec's decode
    ("fp8:format=e4m3", torch.float32),  # a cast to float8 and its bits moved back
    ("fp8:format=e5m2,chunk=256", torch.float64),
]


@needs_compiler
@pytest.mark.parametrize(("spec", "dtype"), SPECS, ids=[f"{s}-{d}" for s, d in SPECS])
def test_compiled_codecs_are_bitwise_the_eager_ones(
    spec: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor with a short last chunk (its tail runs eagerly either way): codes, scales and the
    decoded values equal bit for bit, the prescaled chunks included."""
    x = _gradient(10_000 + 77, dtype)
    eager = _round_trip(spec, x, "0", monkeypatch)
    runs = _compiled_runs()
    fused = _round_trip(spec, x, "1", monkeypatch)
    assert _compiled_runs() - runs == 4  # two steps: encode (sign's codes) and decode compiled
    for a, b in zip(eager, fused, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _part(spec: str, setting: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """Payload and decoded buffer of a part of many tensors (short tails, tiny ones) compressed by rows."""
    monkeypatch.setenv(fusion.ENVIRONMENT, setting)
    shapes = [torch.Size(s) for s in [(64, 70), (5,), (2048,), (3, 1000), (1,), (300,)] * 5]
    offsets = [0]
    for shape in shapes[:-1]:
        offsets.append(offsets[-1] + math.prod(shape))
    segments = Segments(tuple(offsets), tuple(shapes), tuple(range(len(shapes))))
    buffer = _gradient(offsets[-1] + math.prod(shapes[-1]), torch.float32, seed=1)
    compressor: Compressor = make_compressor(spec, seed=5)
    [(payload, ctx)] = compressor.compress_part(buffer.clone(), segments, 2.0)
    out = torch.empty_like(buffer)
    compressor.decompress_part([payload], [ctx], out, segments)
    return (*(t.clone() for t in payload), out)


@needs_compiler
@pytest.mark.parametrize("spec", ["quantize:bits=4", "quantize:bits=4,rounding=nearest"])
def test_a_part_by_rows_compiles_to_the_eager_result(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eager = _part(spec, "0", monkeypatch)
    runs = _compiled_runs()
    fused = _part(spec, "1", monkeypatch)
    assert _compiled_runs() - runs == 2
    for a, b in zip(eager, fused, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_compiler
def test_signs_fused_scales_are_the_eager_ones_within_a_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """By rows, sign's scales (a mean |x| per row) sum in the fused loop's order: within the bound of
    a float32 sum of up to 1024 non-negative terms in another order (2 * 1023 roundings, about 1.2e-4;
    a few roundings in practice); its codes are bitwise the same, so each decoded value moves with
    its row's scale alone."""
    eager = _part("sign", "0", monkeypatch)
    runs = sign._MEAN_ABS.compiled_runs
    fused = _part("sign", "1", monkeypatch)
    assert sign._MEAN_ABS.compiled_runs > runs  # float32 sums, then float64 (a chunk spans +-1e38)
    (codes, scales, decoded), (codes_fused, scales_fused, decoded_fused) = eager, fused
    assert torch.equal(codes, codes_fused)
    bound = 2 * 1023 * 2.0**-24
    torch.testing.assert_close(scales_fused, scales, rtol=bound, atol=0)
    torch.testing.assert_close(decoded_fused, decoded, rtol=bound, atol=0)


@needs_compiler
def test_a_configuration_compiles_once_whatever_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first step, tensors of other sizes (other numbers of rows) and later steps run
    the code already compiled: Dynamo's count of compiled graphs does not move."""
    monkeypatch.setenv(fusion.ENVIRONMENT, "1")
    compressor = make_compressor("quantize:bits=3,chunk=512", seed=0)
    compiled = torch._dynamo.utils.counters["stats"]

    def step(numel: int) -> None:
        payload, ctx = compressor.compress(torch.randn(numel), key=numel)
        compressor.decompress(payload, ctx)

    step(512 * 7)
    step(512 * 9)  # a second number of rows: its dimension is dynamic from the first call
    warm = compiled["unique_graphs"]
    for numel in (512 * 3, 512 * 40 + 5, 512 * 1000, 512 * 7):
        step(numel)
    assert compiled["unique_graphs"] == warm


def _uncompilable(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)
    x.tolist()  # a host read: no whole graph


@needs_compiler
def test_a_kernel_that_cannot_compile_warns_once_and_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fusion.ENVIRONMENT, "1")
    kernel = fusion.Kernel(_uncompilable, "broken")
    x, out = torch.ones(4, 2), torch.zeros(4, 2)
    with pytest.warns(UserWarning, match="broken could not be compiled, it runs eagerly"):
        assert not kernel.run(x, out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernel.run(x, out)  # known to fail: no second attempt, no second warning


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = fusion.Kernel(_uncompilable, "never")
    monkeypatch.setenv(fusion.ENVIRONMENT, "0")
    assert not fusion.enabled(torch.device("cpu")) and not kernel.run(torch.ones(2, 2), torch.zeros(2, 2))
    monkeypatch.setenv(fusion.ENVIRONMENT, "yes")
    with pytest.raises(ValueError, match="GRADCOMP_COMPILE must be one of auto, 1, 0, got 'yes'"):
        fusion.enabled(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["quantize:bits=4", "quantize:bits=4,rounding=nearest", "qsgd", "terngrad"])
def test_triton_kernels_give_the_cpu_results(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled for a GPU (Triton), the codes and decoded values are the CPU's eager ones."""
    x = _gradient(1 << 20, torch.float32)
    monkeypatch.setenv(fusion.ENVIRONMENT, "0")
    cpu = make_compressor(spec, seed=3)
    payload, ctx = cpu.compress(x, key="w")
    expected = (*payload, cpu.decompress(payload, ctx))
    monkeypatch.setenv(fusion.ENVIRONMENT, "1")
    gpu = make_compressor(spec, seed=3)
    payload, ctx = gpu.compress(x.cuda(), key="w")
    for a, b in zip(expected, (*payload, gpu.decompress(payload, ctx)), strict=True):
        assert torch.equal(a, b.cpu())


def test_a_fused_kernel_counts_as_one_launch_and_computes_the_same() -> None:
    """Under ``observing`` (the roofline's fused count) every kernel runs as written, outside the
    operator count, is reported once with its tensors, and the results are the eager ones."""
    x = _gradient(8192, torch.float32)
    compressor = make_compressor("quantize:bits=4", seed=3)
    expected, _ = compressor.compress(x, key="w")
    reported: list[str] = []
    again = make_compressor("quantize:bits=4", seed=3)
    with fusion.observing(lambda kernel, tensors: reported.append(kernel.name)):
        payload, _ = again.compress(x, key="w")
    assert reported == ["min and max", "noise hash", "affine encode"]
    assert all(torch.equal(a, b) for a, b in zip(expected, payload, strict=True))


def test_the_roofline_counts_fewer_launches_fused_whatever_the_tensors() -> None:
    from gradcomp.bench.launches import compare

    one, many = compare("quantize:bits=4,rounding=nearest,ef=true")
    assert many.fused < many.total and abs(many.fused - one.fused) <= 5


@needs_compiler
def test_precompiling_leaves_nothing_to_compile_at_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``precompile`` (what ``hooks.register`` calls) compiles the configurations a training step
    then runs, whatever its tensors' sizes; nothing where nothing compiles."""
    monkeypatch.setenv(fusion.ENVIRONMENT, "1")
    assert fusion.precompile("quantize:bits=4,chunk=256,rounding=nearest", torch.bfloat16) >= 0
    assert fusion.precompile("topk:ratio=0.01") == 0.0  # no fused kernel
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compressor = make_compressor("quantize:bits=4,chunk=256,rounding=nearest,ef=true")
    for numel in (256 * 40 + 3, 256 * 7):
        payload, ctx = compressor.compress(torch.randn(numel).to(torch.bfloat16), key=numel)
        compressor.decompress(payload, ctx)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    monkeypatch.setenv(fusion.ENVIRONMENT, "0")
    assert fusion.precompile("quantize:bits=4") == 0.0


def test_ddp_hooks_and_synchronizers_compile_before_their_first_step(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any) -> None:  # fmt: skip
    """Registering a DDP hook and making a DiLoCo synchronizer each precompile their compressor, for
    the model's dtype (the synchronizer's outer gradients: float32), before any step (one rank)."""
    import torch.distributed as dist

    from gradcomp import hooks, sync

    asked: list[tuple[str, torch.dtype]] = []
    monkeypatch.setattr(fusion, "precompile", lambda spec, dtype, device: asked.append((str(spec), dtype)) or 0.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2).to(torch.float64))
        hooks.register(ddp, "quantize:bits=4,rounding=nearest")
        model = torch.nn.Linear(8, 2)
        sync.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), every=4, spec="sign:ef=true")
    finally:
        dist.destroy_process_group()
    assert [(spec.split(",")[0], dtype) for spec, dtype in asked] == [("quantize:chunk=1024", torch.float64),
                                                                      ("sign:chunk=1024", torch.float32)]  # fmt: skip


def trained_both_ways(rank: int, world: int, specs: list[str]) -> dict[str, Any]:
    """Inside a rank: per spec, the toy model trained 3 DDP steps with the kernels eager, then
    compiled; the parameters must be bitwise alike, and the compiled kernels must have run."""
    import os

    from tests.toy_ddp import sgd_steps, toy_batches, toy_model, wrap

    failures, previous = Failures(), os.environ.get(fusion.ENVIRONMENT)
    try:
        for spec in specs:
            trained = []
            for setting in ("0", "1"):
                os.environ[fusion.ENVIRONMENT] = setting
                runs = _compiled_runs()
                ddp, _ = wrap(toy_model(), spec)
                sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), toy_batches(rank, 3))
                trained.append([p.detach().clone() for p in ddp.parameters()])
                failures.expect((_compiled_runs() > runs) == (setting == "1"), f"{spec}: compiled runs with {setting}")
            same = all(torch.equal(a, b) for a, b in zip(*trained, strict=True))
            failures.expect(same, f"{spec}: training with compiled kernels differs from eager")
    finally:  # a pooled rank serves later tests
        if previous is None:
            os.environ.pop(fusion.ENVIRONMENT, None)
        else:
            os.environ[fusion.ENVIRONMENT] = previous
    return {"failures": failures}


@needs_compiler
def test_ddp_training_with_compiled_kernels_is_bitwise_the_eager_one() -> None:
    """Two gloo ranks, the kernels compiled inside DDP's hooks (backward's thread, the executor's)."""
    specs = ["quantize:bits=4", "fp8:format=e4m3,ef=true", "quantize:bits=4,rounding=nearest,ef=true"]
    run_checks(2, trained_both_ways, (specs,), timeout=240)


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["quantize:bits=4", "sign:ef=true", "fp8:format=e4m3,ef=true", "qsgd"])
def test_compiled_steady_steps_neither_synchronize_nor_allocate_on_a_gpu(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the Triton kernels compiled (the first steps), later steps make no synchronizing call
    (CUDA's sync check set to raise) and no device allocation, as the eager steps of
    ``tests/test_cuda.py``."""
    from gradcomp.compressors import simulate

    monkeypatch.setenv(fusion.ENVIRONMENT, "1")
    shapes = [torch.Size([1024, 512]), torch.Size([512])]
    generator = torch.Generator().manual_seed(0)
    steps = [[torch.randn(1024 * 512 + 512, generator=generator).cuda() for _ in range(2)] for _ in range(6)]
    ranks = [make_compressor(spec, rank=r) for r in range(2)]
    runs = _compiled_runs()
    for step in steps[:2]:  # compiled, then state, workspaces and the cache settle
        simulate(ranks, step, key="w", shapes=shapes)
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps[2:]:
            simulate(ranks, step, key="w", shapes=shapes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments
    assert _compiled_runs() > runs
