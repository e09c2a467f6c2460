"""Hook specs, parsed once: every spelling of one spec gives one HookSpec, whose text is canonical
(it parses back to an equal spec), and a bad spec is refused with the valid choices."""

from __future__ import annotations

import re

import pytest

import gradcomp.hooks  # (auto and torch's hooks tell the engine where their specs go)
import gradcomp.sync  # (and so do localsgd and diloco)
from gradcomp.compressors import parse_spec
from gradcomp.engine import spec as hook_spec
from gradcomp.engine.spec import HookSpec


@pytest.mark.parametrize(
    "spec",
    ["allreduce", "noop", "fp16", "topk:ratio=0.05,ef=true,algo=ring", "quantize:bits=2,aggregation=two_phase,seed=7"],
)
def test_the_text_is_canonical(spec: str) -> None:
    parsed = HookSpec.parse(spec)
    assert HookSpec.parse(str(parsed)) == parsed
    assert str(HookSpec.parse(str(parsed))) == str(parsed)


def test_every_spelling_of_a_spec_is_one_spec() -> None:
    spellings = [
        "topk:ratio=0.05,ef=true,algo=ring",
        " topk : ef = true , ratio=0.050, algo=ring ",
        ("topk", {"ratio": 0.05, "ef": True, "algo": "ring"}),
        HookSpec(parse_spec("topk:ratio=0.05,ef=true"), algo="ring"),
    ]
    parsed = {HookSpec.parse(s) for s in spellings}
    assert len(parsed) == 1
    assert str(parsed.pop()) == "topk:ratio=0.05,method=exact,tolerance=0.2,ef=true,algo=ring"
    assert HookSpec.parse("none") == HookSpec.parse("allreduce") and str(HookSpec.parse("none")) == "allreduce"


def test_engine_options_at_their_defaults_are_left_out_of_the_text() -> None:
    assert str(HookSpec.parse("fp16:algo=native,aggregation=auto,seed=0")) == "fp16"
    assert str(HookSpec.parse("noop:seed=3")) == "noop:seed=3"


def test_defaults_apply_where_the_text_is_silent() -> None:
    assert HookSpec.parse("fp16", seed=5, algo="tree") == HookSpec.parse("fp16:seed=5,algo=tree")
    assert HookSpec.parse("fp16:seed=1", seed=5).seed == 1
    ring = HookSpec.parse("fp16:algo=ring")
    assert HookSpec.parse(ring, algo="tree") is ring  # a parsed spec already says everything
    with pytest.raises(TypeError, match="unknown engine option"):
        HookSpec.parse("fp16", ratio=0.1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topq", r"unknown compressor 'topq' \(did you mean 'topk'\?\); valid: allreduce, noop, auto, torch:"),
        ("fp16:aggregation=two_phase", "two_phase is for gather compressors"),
        ("topk:algo=hierarchical", "unknown all-reduce algorithm 'hierarchical'; valid: native, ring, tree"),
        ("topk:algo=rign", r"unknown all-reduce algorithm 'rign' \(did you mean 'ring'\?\); valid: native, ring"),
        ("noop:ratio=1", "noop takes no options"),
        ("sign:seed=1.5", "seed must be an integer"),
        ("topk:ratio=2", "invalid options for 'topk'"),
        # specs of other kinds say where they go
        ("auto", r"auto is no compressor: .*gradcomp.hooks.register\(ddp_model, 'auto'\)"),
        ("torch:fp16", r"torch's hooks .* are DDP's own.*gradcomp.hooks.register\(ddp_model, 'torch:fp16'\)"),
        ("diloco:every=5", "diloco is a sync spec, not a hook spec"),
        ("topk:ratio=0.1,ef=true,momentum=true", "momentum=true takes a training run's own momentum"),
    ],
)
def test_bad_specs_are_refused_with_the_valid_choices(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HookSpec.parse(spec)


@pytest.mark.parametrize("spec", ["auto", "torch:fp16", "diloco:every=5"])
def test_with_the_engine_alone_other_kinds_are_unknown_compressors(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine names no other kind of spec: those who own one register it (hook_spec.add_other_kind)."""
    monkeypatch.setattr(hook_spec, "OTHER_KINDS", {})
    monkeypatch.setattr(hook_spec, "HOOK_NAMES", {})
    name = spec.partition(":")[0]
    with pytest.raises(ValueError, match=f"unknown compressor '{name}'; valid: allreduce, noop, bf16"):
        HookSpec.parse(spec)


ENGINE_OPTIONS = "algo, aggregation, seed, warmup, min_numel, vectors, pieces, local_size"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # a wrong name: the closest, then every name a DDP hook takes, the hooks' own (auto, torch's) included
        ("topkk:ratio=0.01", "unknown compressor 'topkk' (did you mean 'topk'?); valid: allreduce, noop, auto, "
         "torch:allreduce, torch:allreduce_hook, torch:fp16, torch:bf16, torch:powersgd, bf16, fp16"),
        ("atuo", "unknown compressor 'atuo' (did you mean 'auto'?)"),
        ("Torch_FP16", "unknown compressor 'Torch_FP16' (did you mean 'torch:fp16'?)"),
        ("torch:fp61", "unknown torch hook 'fp61' (did you mean 'torch:fp16'?); valid: torch:allreduce,"),
        # a wrong option: the closest, then every option, error feedback's and the engine's included
        ("topk:ratoi=0.01", "unknown option(s) ['ratoi'] for 'topk' (did you mean 'ratio'?); valid options: "
         f"method, ratio, tolerance, ef, momentum, nesterov, mask, clip, {ENGINE_OPTIONS}"),
        ("sign:ef=true,warmpu=10", "(did you mean 'warmup'?)"),
        ("allreduce:min_numle=5", "unknown option(s) ['min_numle'] for 'none' (did you mean 'min_numel'?)"),
        ("topk:ratoi=0.1,methd=exact", "(did you mean 'method' for 'methd', 'ratio' for 'ratoi'?)"),
        ("topk:method=exakt", "option 'method' must be one of exact, sampled; got 'exakt' (did you mean 'exact'?)"),
        ("auto:rechek=5", "unknown auto option 'rechek=5' (did you mean 'recheck'?); valid: candidates,"),
        ("auto:candidates=fp61|sign", "unknown compressor 'fp61' (did you mean 'fp16'?)"),
        ("torch:powersgd:rnak=2", "unknown option(s) ['rnak'] for torch:powersgd (did you mean 'rank'?)"),
        ("sign:vectors=dens", "vectors must be one of compressed, dense, got 'dens' (did you mean 'dense'?)"),
    ],
)  # fmt: skip
def test_a_wrong_spec_is_one_line_with_the_closest_and_every_valid_choice(spec: str, message: str) -> None:
    """gradcomp.hooks.parse (what README and docs point a user at) checks any spec a DDP hook takes."""
    with pytest.raises(ValueError) as info:
        gradcomp.hooks.parse(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topkk", "unknown compressor 'topkk' (did you mean 'topk'?); valid: torch:reduce_scatter, torch:bf16, "
         "torch:fp16, none, noop, bf16"),
        ("torch:bf61", "unknown FSDP2 reduction 'torch:bf61' (did you mean 'torch:bf16'?); valid in sharded runs:"),
        ("quantize:bits=4,param_bit=8", "(did you mean 'param_bits'?); valid options: bits,"),
    ],
)  # fmt: skip
def test_a_wrong_sharded_spec_lists_what_a_sharded_run_takes(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        gradcomp.hooks.parse_sharded(spec)
    assert message in str(info.value) and "auto" not in str(info.value) and "powersgd" not in str(info.value)
    if spec == "topkk":  # and so does an HSDP run's
        with pytest.raises(ValueError, match=re.escape(message)):
            gradcomp.hooks.parse_hybrid(spec)


@pytest.mark.parametrize("spec", ["auto", "auto:recheck=50", "torch:fp16", "torch:powersgd:rank=2", "topk:ratio=0.1"])
def test_hooks_parse_takes_every_kind_and_hook_spec_parse_points_there(spec: str) -> None:
    assert str(gradcomp.hooks.parse(str(gradcomp.hooks.parse(spec)))) == str(gradcomp.hooks.parse(spec))
    if spec.startswith(("auto", "torch:")):
        with pytest.raises(ValueError, match=r"gradcomp\.hooks\.parse checks it"):
            HookSpec.parse(spec)


def register_twice(rank: int, world: int) -> list[str]:
    """What registering a second hook on a DDP model says, for a first hook of each kind."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    said = []
    for first in ("fp16:algo=ring", "torch:fp16", "auto"):
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        gradcomp.hooks.register(model, first)
        for second in ("topk:ratio=0.5", "torch:bf16"):
            try:
                gradcomp.hooks.register(model, second)
            except ValueError as error:
                said.append(str(error))
    return said


def test_a_second_hook_on_a_ddp_model_is_refused_naming_the_first() -> None:
    from tests.distributed import spawn_ranks

    said = spawn_ranks(1, register_twice, timeout=60)[0]
    assert len(said) == 6
    firsts = ("fp16:algo=ring", "fp16:algo=ring", "torch:fp16", "torch:fp16", "auto", "auto")
    for message, first in zip(said, firsts, strict=True):
        assert message.startswith(f"this DDP model has a communication hook already ({first}")
        assert "DDP takes one per model" in message and "\n" not in message


def test_another_kind_cannot_take_a_hook_name() -> None:
    for name in ("topk", "allreduce", "noop"):
        with pytest.raises(ValueError, match=f"'{name}' is a hook spec's name already"):
            hook_spec.add_other_kind(name, "elsewhere")


def test_every_list_of_specs_splits_by_one_rule() -> None:
    """';' always separates; ',' too unless an option follows; '|' stays inside a spec (auto's candidates)."""
    from gradcomp.netem import parse_profiles
    from gradcomp.options import split_list

    assert split_list("fp16,topk:ratio=0.01,ef=true;powersgd") == ["fp16", "topk:ratio=0.01,ef=true", "powersgd"]
    assert split_list("auto:candidates=fp16|sign:ef=true,measure_at=3;fp16") == [
        "auto:candidates=fp16|sign:ef=true,measure_at=3",
        "fp16",
    ]
    assert split_list("a;;b, ,c") == ["a", "b", "c"]
    assert parse_profiles("rate=1gbit,delay=2ms,jitter=1ms,loopback") == ["rate=1gbit,delay=2ms,jitter=1ms", "loopback"]
    assert parse_profiles("loopback,1gbit") == ["loopback", "1gbit"]
