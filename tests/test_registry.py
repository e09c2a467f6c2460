"""Spec parsing: the same names and options in Python, on the command line and in sweep configs."""

from __future__ import annotations

import dataclasses

import pytest

from gradcomp.compressors import REGISTRY, Aggregation, Capabilities, make_compressor, parse_spec
from gradcomp.compressors.quantize import QuantizeConfig
from gradcomp.compressors.topk import TopKConfig
from tests.helpers import SPECS


def test_string_and_tuple_specs_agree() -> None:
    a = parse_spec("topk:ratio=0.02,method=sampled")
    b = parse_spec(("topk", {"ratio": 0.02, "method": "sampled"}))
    assert a == b
    assert a.config == TopKConfig(ratio=0.02, method="sampled")


def test_spec_string_round_trips() -> None:
    spec = parse_spec("quantize:bits=2,rounding=nearest,ef=true")
    assert spec.ef
    assert parse_spec(str(spec)) == spec


def test_defaults_and_whitespace() -> None:
    assert parse_spec(" quantize ").config == QuantizeConfig()
    assert parse_spec("quantize: bits = 3 , chunk=16").config == QuantizeConfig(bits=3, chunk=16)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown compressor 'topq'") as info:
        parse_spec("topq:ratio=0.1")
    for name in REGISTRY:
        assert name in str(info.value)


def test_unknown_option_lists_valid_options() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['k'\] for 'topk'.*method.*ratio.*ef"):
        parse_spec("topk:k=10")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("quantise:bits=4", "unknown compressor 'quantise' (did you mean 'quantize'?); valid: bf16, fp16"),
        ("PowerSGD", "(did you mean 'powersgd'?)"),
        ("quantize:bit=4", "unknown option(s) ['bit'] for 'quantize' (did you mean 'bits'?); valid options:"),
        ("topk:ratio=0.1,eff=true", "(did you mean 'ef'?)"),
        ("quantize:rounding=nearset", "got 'nearset' (did you mean 'nearest'?)"),
    ],
)
def test_a_wrong_name_or_option_says_which_was_meant(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_spec(spec)
    assert message in str(info.value)
    with pytest.raises(ValueError, match="unknown compressor 'zip'; valid: "):  # nothing close: no guess
        parse_spec("zip")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topk:ratio=0", r"ratio must be in \(0, 1\]"),
        ("topk:ratio=1.5", r"ratio must be in \(0, 1\]"),
        ("randomk:ratio=-0.1", r"ratio must be in \(0, 1\]"),
        ("quantize:bits=0", r"bits must be in 1..8"),
        ("quantize:bits=9", r"bits must be in 1..8"),
        ("qsgd:bits=1", r"qsgd bits must be in 2..8"),
        ("quantize:chunk=0", r"chunk must be >= 1"),
        ("quantize:rounding=up", r"rounding.*stochastic, nearest"),
        ("fp8:format=e3m4", r"format.*e4m3, e5m2"),
        ("powersgd:rank=0", r"rank must be >= 1"),
        ("threshold:tau=-1", r"tau must be a finite number >= 0"),
        ("quantize:bits=four", r"'bits' must be an integer"),
        ("topk:ratio=lots", r"'ratio' must be a number"),
        ("topk:ratio=nan", r"'ratio' must be a finite number"),
        ("threshold:tau=inf", r"'tau' must be a finite number"),
        ("randomk:scale=maybe", r"'scale' must be true or false"),
        ("randomk:ratio=0.01,ef=true", r"'randomk' with ef=true: .* no contraction .* use randomk:scale=false,ef=true"),
        ("topk:ef=perhaps", r"'ef' must be true, false or ef21"),
        ("topk:ratio", r"not of the form key=value"),
        ("topk:ratio=0.1,ratio=0.2", r"given twice"),
    ],
)
def test_bad_values_are_refused_clearly(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_typed_values_are_checked_too() -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        parse_spec(("quantize", {"bits": 2.5}))
    with pytest.raises(ValueError, match="must be a number"):
        parse_spec(("topk", {"ratio": True}))
    with pytest.raises(TypeError, match="string or a"):
        parse_spec(42)  # type: ignore[arg-type]


def test_make_compressor_wraps_error_feedback() -> None:
    plain = make_compressor("sign")
    wrapped = make_compressor("sign:ef=true")
    assert not plain.has_feedback and plain.codec is plain
    assert wrapped.has_feedback and wrapped.codec.name == wrapped.name and not wrapped.codec.has_feedback
    assert wrapped.capabilities.aggregation is plain.capabilities.aggregation
    assert repr(wrapped).endswith("ef=true")


def test_config_type_is_checked() -> None:
    with pytest.raises(TypeError, match="takes a TopKConfig"):
        REGISTRY["topk"](QuantizeConfig())


def test_the_shared_spec_list_covers_every_registered_compressor() -> None:
    assert {spec.split(":")[0] for spec in SPECS} == set(REGISTRY)


@pytest.mark.parametrize("feedback", ["", "ef=true", "ef=ef21", "ef=true,momentum=0.9,clip=1.0"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_spec_declares_what_its_compressor_does(spec: str, feedback: str) -> None:
    """``Spec.capabilities`` (what the engine's checks and the cost model read) is the record of the
    compressor the spec builds, error feedback's changes included."""
    if feedback and parse_spec(spec).capabilities.feedback_problem:
        return  # no error feedback around it
    text = f"{spec},{feedback}" if ":" in spec and feedback else (f"{spec}:{feedback}" if feedback else spec)
    built = make_compressor(text)
    assert parse_spec(text).capabilities == built.capabilities
    if feedback:
        inner, outer = built.codec.capabilities, built.capabilities
        changed = {f.name for f in dataclasses.fields(Capabilities) if getattr(inner, f.name) != getattr(outer, f.name)}
        assert changed <= {"elementwise", "local", "unbiased", "feedback_problem", "whole_part"}
        assert not outer.elementwise and not outer.unbiased
        assert outer.local == (inner.local and "clip" not in feedback)
        classic = feedback == "ef=true"  # a whole part at once: classic error feedback alone
        assert outer.whole_part == (inner.whole_part and classic and inner.rounds == 1)


def test_a_record_refuses_what_cannot_hold() -> None:
    assert Capabilities(Aggregation.GATHER) == Capabilities(Aggregation.GATHER, rounds=1, ratio=None)
    for bad, message in [
        ({"rounds": 0}, "rounds must be an integer >= 1"),
        ({"piece_multiple": 2.5}, "piece_multiple must be an integer"),
        ({"ratio": 0.0}, "ratio must be in"),
        ({"dense_from": 0.0}, "dense_from must be in"),
        ({"same_shapes": True, "measures": True}, "contradict"),
    ]:
        with pytest.raises(ValueError, match=message):
            Capabilities(Aggregation.GATHER, **bad)
    with pytest.raises(TypeError, match="must be an Aggregation"):
        Capabilities("gather")  # type: ignore[arg-type]
