"""Tools for those who write compressors: :func:`check_compressor`, the compressor contract as one call.

>>> from gradcomp.testing import check_compressor
>>> check_compressor("mysign:ef=true")            # one process
>>> check_compressor(MySign, ranks=2)             # and through the engine on two gloo ranks

Each property of the contract (``gradcomp/compressors/base.py``; the list in
:data:`gradcomp.testing.properties.PROPERTIES`) runs on fixed inputs; a compressor that breaks any
raises one ``AssertionError`` naming every property it breaks and how. Costs: about a second on one
process for a compressor of gradcomp's; ``ranks`` starts that many processes (seconds each).
"""

from __future__ import annotations

import dataclasses

from gradcomp.compressors.base import Compressor
from gradcomp.compressors.registry import SpecLike
from gradcomp.testing import across_ranks
from gradcomp.testing.properties import PROPERTIES
from gradcomp.testing.subject import Skip, Subject

__all__ = ["Conformance", "check_compressor"]


@dataclasses.dataclass(frozen=True)
class Conformance:
    """What :func:`check_compressor` found for a compressor that keeps the contract."""

    compressor: str
    """The spec, or the class, checked."""
    passed: tuple[str, ...]
    """The properties it keeps."""
    skipped: dict[str, str]
    """The properties that do not apply to it, and why (error feedback around an unbiased scaler)."""


def check_compressor(
    compressor: SpecLike | type[Compressor], *, ranks: int = 1, timeout: float = 180.0
) -> Conformance:
    """Check that a compressor keeps gradcomp's compressor contract.

    Args:
        compressor: a spec of a registered compressor (``"mysign"``, ``"mysign:chunk=64,ef=true"``)
            or a :class:`~gradcomp.compressors.base.Compressor` subclass (with its default config;
            it need not be registered).
        ranks: with 2 or more, also average through gradcomp's engine on that many gloo processes
            and check that every rank gets bitwise the same, which the simulated protocol predicts
            (the class must be importable by name there: defined in a module, not ``__main__``).
        timeout: seconds the ranks may take, in all.

    Raises:
        AssertionError: naming each property the compressor breaks, and how.
        TypeError, ValueError: for a spec or class that cannot be built.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
    subject = Subject(compressor)
    passed, skipped, failures = [], {}, []
    for name, prop in PROPERTIES:
        try:
            prop(subject)
        except Skip as reason:
            skipped[name] = str(reason)
        except AssertionError as error:
            failures.append(f"{name}: {error}")
        except Exception as error:  # a property that crashes is broken, and says so by name
            failures.append(f"{name}: raised {type(error).__name__}: {error}")
        else:
            passed.append(name)
    if ranks > 1:
        for name, problem in across_ranks.check(subject, ranks, timeout):
            name = f"across {ranks} ranks, {name}"
            if problem is None:
                passed.append(name)
            else:
                failures.append(f"{name}: {problem}")
    if failures:
        broken = "\n".join(f"- {failure}" for failure in failures)
        raise AssertionError(f"{subject.label} breaks the compressor contract:\n{broken}")
    return Conformance(subject.label, tuple(passed), skipped)
