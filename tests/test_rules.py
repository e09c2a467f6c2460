"""The one table of refusals: every combination it does not refuse is planned, on every surface."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from gradcomp.compressors import parse_spec
from gradcomp.engine import rules
from gradcomp.engine.plan import Context, Route, plan_bucket, segments_of
from gradcomp.engine.spec import HookSpec
from gradcomp.hooks.auto_spec import AutoSpec

COMPRESSORS = [None, "none", "fp16", "quantize:bits=4", "sign:ef=true", "sign:ef=ef21", "topk:ratio=0.01,ef=true",
               "randomk:ratio=0.1,scale=false", "powersgd:rank=2,ef=true", "threshold:tau=0.01"]  # fmt: skip
OPTIONS = {
    "aggregation": ["auto", "gather", "two_phase"],
    "warmup": [0, 2],
    "min_numel": [0, 100],
    "vectors": ["compressed", "dense"],
    "local_size": [0, 2],
    "pieces": [1, 2],
}
SHAPES = [torch.Size((2**19 + 4, 2)), torch.Size((30,)), torch.Size((40, 50))]


def combinations() -> list[rules._View]:
    names = list(OPTIONS)
    return [
        rules._View(None if c is None else parse_spec(c), "native", values[0], 0, *values[1:])
        for c in COMPRESSORS
        for values in itertools.product(*(OPTIONS[n] for n in names))
    ]


def test_every_combination_the_table_allows_is_planned_and_every_other_refused_with_its_reason() -> None:
    """The grid of every compressor kind and engine option: HookSpec refuses exactly what the table
    refuses (with the table's reason), and plans the rest at every step, on every rank of 2 nodes."""
    planned = refused = 0
    numel = sum(math.prod(s) for s in SHAPES)
    for options in combinations():
        reason = rules.refusal(options)
        fields = {f: getattr(options, f) for f in ("algo", "aggregation", "seed", "warmup", "min_numel", "vectors",
                                                   "local_size", "pieces")}  # fmt: skip
        if reason is not None:
            with pytest.raises(ValueError, match=re.escape(reason)):
                HookSpec(options.compressor, **fields)
            refused += 1
            continue
        spec = HookSpec(options.compressor, **fields)
        segments = segments_of(spec, numel, [0, 1, 2], SHAPES)
        for step, local_rank, last in itertools.product((0, 5), (0, 1), (False, True)):
            made = plan_bucket(spec, Context(4, local_rank), step, segments, last=last)
            covered = sorted(i for part in made.parts for s in part.segments for i in (s.offset, s.stop))
            assert made.numel == numel and covered[0] == 0 and covered[-1] == numel, spec
        planned += 1
    assert planned > 500 and refused > 100, (planned, refused)


@pytest.mark.parametrize(
    ("text", "surface", "message"),
    [
        ("noop", rules.Surface.AUTO, "cannot be an auto candidate"),
        ("noop", rules.Surface.SYNC, "would never synchronize"),
        ("noop", rules.Surface.CARRIER, "drift apart"),
        ("topk:ratio=0.1,ef=true,momentum=0.9", rules.Surface.CARRIER, "momentum correction would apply a second"),
        ("powersgd:rank=2", rules.Surface.FSDP2, "FSDP2's reduce-scatter takes a flat shard"),
        ("powersgd:rank=2", rules.Surface.HSDP, "HSDP's all-reduce across nodes takes a flat shard"),
        ("sign:ef=true,min_numel=10", rules.Surface.HSDP, "an HSDP shard is flat"),
        ("sign:ef=true,local_size=2", rules.Surface.HSDP, "leave local_size out"),
        ("sign:ef=true,pieces=2", rules.Surface.FSDP2, "one call"),
        ("sign:ef=true,algo=tree", rules.Surface.FSDP2, "native or ring, got 'tree'"),
        ("sign:ef=true,aggregation=gather", rules.Surface.FSDP2, "got 'gather'"),
        ("sign:ef=true,warmup=2", rules.Surface.FSDP2, "leave it out"),
        ("sign:ef=ef21", rules.Surface.FSDP2, "use ef=true"),
    ],
)
def test_a_surface_refuses_what_it_cannot_run_and_the_others_plan_it(
    text: str, surface: rules.Surface, message: str
) -> None:
    spec = HookSpec.parse(text)
    with pytest.raises(ValueError, match=message):
        rules.check(spec, surface)
    assert rules.refusal(spec, rules.Surface.DDP) is None


def test_the_planner_asks_the_table_which_variants_exist() -> None:
    ef21 = HookSpec.parse("sign:ef=ef21")
    assert rules.derive(ef21, aggregation="two_phase") is None
    assert rules.derive(ef21, aggregation="gather") == HookSpec.parse("sign:ef=ef21,aggregation=gather")
    across = rules.derive(HookSpec.parse("sign:ef=true,vectors=dense,pieces=2"), local_size=4)
    assert across is not None and across.local_size == 4  # refused "not yet" before the plan composed them
    assert rules.derive(HookSpec.parse("fp16"), rules.Surface.HSDP, local_size=2) is None


def test_auto_takes_candidates_in_pieces_and_across_nodes() -> None:
    spec = AutoSpec.parse("auto:candidates=sign:ef=true,pieces=2|quantize:bits=4,local_size=2,pieces=2")
    assert [HookSpec.parse(c).pieces for c in spec.candidates] == [2, 2] and spec.local_size == 2


def test_the_table_prints_every_rule_with_where_and_why() -> None:
    rows = rules.table()
    assert len(rows) == len(rules.RULES)
    assert rows[5][:2] == ("ef21 with two_phase", "every surface")
    assert all(reason for _, _, reason in rows)


def test_a_combination_of_the_policy_and_nodes_sends_the_policys_tensors_flat() -> None:
    spec = HookSpec.parse("sign:ef=true,min_numel=100,local_size=2")
    made = plan_bucket(spec, Context(4), 9, segments_of(spec, sum(math.prod(s) for s in SHAPES), [0, 1, 2], SHAPES))
    assert [p.route for p in made.parts] == [Route.NODES, Route.DENSE]
