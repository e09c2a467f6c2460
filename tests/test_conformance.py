"""The conformance kit, gradcomp.testing.check_compressor: every compressor of gradcomp keeps the
contract, and each planted broken one (tests/broken_compressors.py) fails it by the property it breaks."""

from __future__ import annotations

import pytest

from gradcomp.compressors.topk import TopK
from gradcomp.testing import check_compressor
from gradcomp.testing.properties import PROPERTIES
from tests import broken_compressors as broken
from tests.helpers import SPECS, with_feedback


@pytest.mark.parametrize("spec", [*SPECS, *(with_feedback(s) for s in SPECS)])
def test_every_compressor_of_gradcomp_keeps_the_contract(spec: str) -> None:
    result = check_compressor(spec)
    assert set(result.passed) | set(result.skipped) == {name for name, _ in PROPERTIES}
    # error feedback is the only property a compressor can be excused from, and says why
    assert set(result.skipped) <= {"error feedback"}
    if spec == "randomk:ratio=0.1":
        assert "no contraction" in result.skipped["error feedback"]


def test_a_class_checks_with_its_default_config() -> None:
    assert check_compressor(TopK).compressor == "gradcomp.compressors.topk.TopK"


@pytest.mark.parametrize(
    ("cls", "property", "says"),
    [
        (broken.CountsElements, "wire bytes", "says 2 bytes for round 1's payload of a (1,) tensor, which holds 5"),
        (broken.ShiftedDecode, "decompression", "no closer to x than zeros are"),
        (broken.IndicesAtHome, "payload only", "the context carries what only the sender has"),
        (broken.GlobalRandom, "determinism", "two builds with seed 5, rank 0 made different payloads"),
        (broken.OwnRankFirst, "aggregation", "rank 1's aggregate differs from rank 0's"),
        (broken.ForgetsItsGenerator, "checkpoints", "resumed, step 4's payload differs"),
        (broken.DropsNaN, "non-finite input", "nan at element 0 was dropped"),
    ],
)
def test_a_broken_compressor_fails_naming_the_property(cls: type, property: str, says: str) -> None:
    with pytest.raises(AssertionError) as failure:
        check_compressor(cls)
    message = str(failure.value)
    assert message.startswith(f"tests.broken_compressors.{cls.__name__} breaks the compressor contract")
    assert f"- {property}: " in message and says in message, message


def test_ranks_average_through_the_engine_bitwise_alike() -> None:
    """On two gloo ranks: a sound compressor passes (with its residuals); one whose payloads each
    rank decodes with its own indices ends with other averages on each rank."""
    result = check_compressor("topk:ratio=0.05,ef=true", ranks=2)
    assert {"across 2 ranks, the same on every rank", "across 2 ranks, the engine agrees with the protocol"} <= set(
        result.passed
    )
    with pytest.raises(AssertionError, match="- across 2 ranks, the same on every rank: step 1: rank 1's average"):
        check_compressor(broken.IndicesAtHome, ranks=2)


def test_what_cannot_be_checked_is_refused() -> None:
    with pytest.raises(TypeError, match="a spec or a Compressor subclass, got int"):
        check_compressor(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown compressor 'nosuch'"):
        check_compressor("nosuch")
    with pytest.raises(ValueError, match="ranks must be an integer >= 1"):
        check_compressor("sign", ranks=0)
