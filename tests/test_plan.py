"""The plan of a bucket: a pure function of the spec, the context, the step and the tensors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gradcomp.compressors.keys import StateKey
from gradcomp.engine.hierarchical import NodeShards
from gradcomp.engine.plan import BucketPlan, Context, Route, Transfer, plan_bucket, segments_of
from gradcomp.engine.spec import HookSpec
from tests.distributed import Failures, identical_on_all_ranks, run_checks

SHAPES = [torch.Size((300, 200)), torch.Size((200,)), torch.Size((10,)), torch.Size((400, 300))]
KEYS = [0, 1, 2, 3]


def plan(text: str, world: int = 2, step: int = 100, last: bool = False, **context: object) -> BucketPlan:
    spec = HookSpec.parse(text)
    segments = segments_of(spec, sum(math.prod(s) for s in SHAPES), KEYS, SHAPES)
    return plan_bucket(spec, Context(world, **context), step, segments, bucket=3, last=last)  # type: ignore[arg-type]


def test_the_plan_is_a_pure_immutable_function_of_its_inputs() -> None:
    first, again = plan("topk:ratio=0.01,ef=true,min_numel=100"), plan("topk:ratio=0.01,ef=true,min_numel=100")
    assert first == again and hash(first) == hash(again)
    with pytest.raises(AttributeError):
        first.bucket = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "route", "transfer"),
    [
        ("allreduce", Route.SUM, None),
        ("fp16", Route.SUM, None),
        ("powersgd:rank=2,ef=true", Route.SUM, None),
        ("quantize:bits=4", Route.GATHER, Transfer.IN_FLIGHT),
        ("quantize:bits=4,algo=ring", Route.GATHER, Transfer.ALIKE),
        ("threshold:tau=0.1", Route.GATHER, Transfer.PADDED),
        ("threshold:tau=0.1,algo=ring", Route.GATHER, Transfer.SIZED),
        ("sign:ef=true,aggregation=two_phase", Route.TWO_PHASE, None),
    ],
)
def test_each_spec_takes_its_route(text: str, route: Route, transfer: Transfer | None) -> None:
    (part,) = plan(text).parts
    assert (part.route, part.transfer) == (route, transfer)


def test_casts_take_the_bucket_whole_and_the_others_each_tensor_keyed() -> None:
    (cast,) = plan("fp16").parts
    assert [(s.key, s.offset, s.numel) for s in cast.segments] == [(None, 0, sum(math.prod(s) for s in SHAPES))]
    (signs,) = plan("sign:ef=true").parts
    assert signs.keys == tuple(KEYS) and [s.shape for s in signs.segments] == SHAPES


def test_two_phase_from_eight_ranks_unless_ef21() -> None:
    assert plan("sign:ef=true", world=7).parts[0].route is Route.GATHER
    assert plan("sign:ef=true", world=8).parts[0].route is Route.TWO_PHASE
    assert plan("sign:ef=ef21", world=8).parts[0].route is Route.GATHER


def test_a_payload_sized_by_its_values_is_measured_on_an_accelerator_only() -> None:
    assert plan("topk:ratio=0.01,method=sampled").parts[0].transfer is Transfer.PADDED
    assert plan("topk:ratio=0.01,method=sampled", accelerator=True).parts[0].transfer is Transfer.MEASURED
    assert plan("topk:ratio=0.01", accelerator=True).parts[0].transfer is Transfer.IN_FLIGHT  # exact: same shapes


def test_the_warm_up_goes_dense_then_falls_to_the_ratio_then_settles() -> None:
    dense = plan("quantize:bits=4,ef=true,warmup=2", step=1)
    assert [p.route for p in dense.parts] == [Route.DENSE] and not dense.settled and "warm-up step 2 of 2" in str(dense)
    assert plan("quantize:bits=4,ef=true,warmup=2", step=2).settled
    # top-k 1% over 3 steps: 0.01 ** (1/4) = 0.32, then 0.01 ** (2/4) = 0.1, ...; 0.5 and up would go dense
    falling = [plan("topk:ratio=0.01,ef=true,warmup=3", step=s).parts[0] for s in range(4)]
    assert [p.ratio for p in falling[:3]] == pytest.approx([0.01**0.25, 0.01**0.5, 0.01**0.75])
    assert falling[0].transfer is Transfer.SIZED and falling[3].ratio is None  # settled: its own ratio


def test_the_policy_sends_small_and_one_dimensional_tensors_uncompressed() -> None:
    made = plan("sign:ef=true,vectors=dense,min_numel=1000")
    (send,) = made.sends
    compressed, dense = send.parts
    assert compressed.keys == (0, 3) and dense.route is Route.DENSE and dense.keys == (1, 2)
    assert send.uncompressed == 210 and dense.contiguous  # 1 and 2 are neighbours
    cast = plan("fp16:min_numel=1000")  # a cast's uncompressed tensors, keyless runs of the buffer
    assert [(s.key, s.offset, s.numel) for s in cast.parts[1].segments] == [(None, 60000, 210)]


def test_only_the_steps_last_bucket_travels_in_pieces() -> None:
    assert len(plan("quantize:bits=4,pieces=2").sends) == 1
    sends = plan("quantize:bits=4,pieces=2", last=True).sends
    assert [s.piece for s in sends] == [0, 1] and sends[0].stop == sends[1].start
    assert [s.parts[0].keys for s in sends] == [(0, 1, 2), (3,)]


def test_across_nodes_this_ranks_shard_is_its_piece_of_every_tensor() -> None:
    made = plan("topk:ratio=0.1,ef=true,local_size=2", world=4, local_rank=1)
    (part,) = made.parts
    assert part.route is Route.NODES and part.inner is not None and part.inner.route is Route.GATHER
    shards = NodeShards(tuple(SHAPES), 2)
    assert [s.shape for s in part.inner.segments] == shards.shard_shapes(1)
    assert part.inner.keys == tuple(StateKey.of(k).of_node(1) for k in KEYS)
    assert part.inner.segments[0].offset == 0 and part.inner.numel == shards.bounds[1][1] - shards.bounds[1][0]


def test_combinations_that_were_refused_compose() -> None:
    """local_size with pieces and with the per-tensor policy: a plan, not a refusal."""
    sends = plan("quantize:bits=4,local_size=2,pieces=2", world=4, last=True).sends
    assert len(sends) == 2 and all(s.parts[0].route is Route.NODES for s in sends)
    routes = [p.route for p in plan("sign:ef=true,local_size=2,min_numel=1000", world=4).parts]
    assert routes == [Route.NODES, Route.DENSE]


def test_the_plan_reads_as_what_each_tensor_does_and_why() -> None:
    text = str(plan("sign:ef=true,min_numel=1000", world=2))
    assert "bucket 3:" in text and "tensor 3 (400, 300) at 60210" in text
    assert "uncompressed by the per-tensor policy: fewer than 1000 elements" in text
    assert "all-gathered (same shapes on every rank): the backend's, in flight" in text


def test_segments_cover_the_bucket_once_and_keys_must_describe_it() -> None:
    spec = HookSpec.parse("quantize:bits=4,pieces=4")
    big = [torch.Size((2**20,)), torch.Size((3,))]
    segments = segments_of(spec, 2**20 + 3, [0, 1], big)
    assert [s.offset for s in segments] == [0, 2**18, 2**19, 3 * 2**18, 2**20]
    assert segments[1].key == StateKey.of(0).of_piece(1)
    with pytest.raises(ValueError, match="do not describe a buffer of 7"):
        segments_of(spec, 7, [0, 1], big)
    with pytest.raises(ValueError, match="needs the keys and shapes"):
        segments_of(spec, 7, None, None)


def test_explain_prints_every_buckets_plan_by_parameter_name(capsys: pytest.CaptureFixture[str]) -> None:
    from gradcomp.cli import main

    assert main(["explain", "sign:ef=true,vectors=dense", "--model", "mlp", "--ranks", "8"]) == 0
    out = capsys.readouterr().out
    assert "on 8 ranks, mlp (6,316,042 parameters)" in out and "bucket 0:" in out
    assert "tensor '5.bias' (10,) at 0" in out and "1-D (vectors=dense)" in out
    assert "two_phase" in out  # 8 ranks
    assert main(["explain", "--rules"]) == 0
    assert "ef21 with two_phase [every surface]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["explain", "topk:ratio=0.01,local_size=3", "--ranks", "8"])
    assert "a multiple of local_size" in capsys.readouterr().err


def _whole_parts(rank: int, world: int) -> Failures:
    """The engine hands a compressor all the tensors of a part in one call (compress_part and the
    methods beside it), and the default, one by one, gives what per-tensor calls give."""
    from gradcomp.engine import Engine

    failures = Failures()
    shapes = [torch.Size((40, 30)), torch.Size((30,)), torch.Size((7, 3)), torch.Size((5,))]
    numel = sum(math.prod(s) for s in shapes)
    calls: dict[str, int] = {}
    for spec in ("sign:ef=true,vectors=dense", "topk:ratio=0.1,ef=true", "randomk:ratio=0.2,scale=false,ef=true"):
        engine = Engine(spec)
        for name in ("compress_part", "decompress_part", "decompress_sum_part"):
            method = getattr(engine.compressor, name)

            def counted(*args: object, _method: Any = method, _name: str = name, **kwargs: object) -> object:
                calls[_name] = calls.get(_name, 0) + 1
                return _method(*args, **kwargs)

            setattr(engine.compressor, name, counted)
        calls.clear()
        bucket = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        averaged = engine.reduce(bucket.clone(), [0, 1, 2, 3], shapes, last=True).wait()
        engine.end_step()
        decompressions = calls.get("decompress_part", 0) + calls.get("decompress_sum_part", 0)
        failures.expect(calls.get("compress_part") == 1 and decompressions == 1, f"{spec}: calls {calls}")
        reference = Engine(spec)
        again = reference.reduce(bucket.clone(), [0, 1, 2, 3], shapes, last=True).wait()
        failures.expect(torch.equal(averaged, again) and identical_on_all_ranks(averaged), f"{spec}: results differ")
    return failures


def test_a_compressor_takes_a_whole_part_in_one_call() -> None:
    run_checks(2, _whole_parts, timeout=120)
