"""One key type for every part of a tensor's state, and where each part lies in its tensor."""

from __future__ import annotations

import io
import math

import pytest
import torch

from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors import make_compressor
from gradcomp.compressors.keys import StateKey, of_parameter, plain
from gradcomp.compressors.randomness import key_seed
from gradcomp.engine import pieces
from gradcomp.engine.handover import Cuts, take_residual
from gradcomp.engine.hierarchical import NodeShards

PARTS = [
    StateKey(7),
    StateKey.of(7).of_piece(2),
    StateKey.of(7).of_node(1),
    StateKey.of(7).of_piece(0).of_node(1).of_shard(3),
    StateKey.of("block.0").of_hop("intra").of_shard(1),
    StateKey.of(("block.0", 4096)).of_hop("inter").of_shard(0),
    StateKey.of(7).of_reduced(2),
    StateKey.of(7).of_node(0).of_reduced(1),
]


@pytest.mark.parametrize("key", PARTS, ids=str)
def test_a_key_is_its_plain_form_and_parses_back(key: StateKey) -> None:
    form = key.plain()
    assert key == form and hash(key) == hash(form) and {form: 1}[key] == 1
    assert StateKey.parse(form) == key and StateKey.parse(form).parameter == key.parameter
    assert key_seed(5, key) == key_seed(5, form)  # random streams do not depend on the form


def test_the_plain_forms_are_those_checkpoints_already_hold() -> None:
    assert StateKey.of(3).of_piece(1).plain() == (3, "piece", 1)
    assert StateKey.of(3).of_node(0).plain() == (3, "node", 0)
    assert StateKey.of(3).of_shard(2).plain() == (3, 2)
    assert StateKey.of(3).of_reduced(1).plain() == (3, "reduced", 1)
    assert StateKey.of("m").of_hop("intra").of_shard(1).plain() == (("m", "intra"), 1)
    assert StateKey.of(3).plain() == 3 and plain(3) == 3


def test_a_part_is_cut_once_per_kind_and_hops_are_named() -> None:
    with pytest.raises(ValueError, match="already names its piece"):
        StateKey.of(1).of_piece(0).of_piece(1)
    with pytest.raises(ValueError, match="already names its shard"):
        StateKey.of(1).of_shard(0).of_reduced(0)
    with pytest.raises(ValueError, match="unknown hop 'across'; valid: intra, inter"):
        StateKey(1, hop="across")
    with pytest.raises(TypeError, match=r"use StateKey\.of"):
        StateKey(StateKey(1))


def test_everything_of_a_parameter_is_one_query_over_either_form() -> None:
    held = [3, (3, 0), StateKey.of(3).of_reduced(1), ((3, "node", 0), 1), 4, (4, "piece", 0), "3"]
    assert of_parameter(held, 3) == held[:4]
    assert of_parameter(held, 4) == [4, (4, "piece", 0)]


def test_state_saved_under_keys_loads_weights_only_and_is_found_again() -> None:
    compressor = make_compressor("topk:ratio=0.1,ef=true")
    key = StateKey.of(2).of_node(1).of_shard(0)
    compressor.compress(torch.randn(100), key)
    buffer = io.BytesIO()
    torch.save(compressor.state_dict(), buffer)
    buffer.seek(0)
    again = make_compressor("topk:ratio=0.1,ef=true")
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert again.state_keys() == [key.plain()]
    assert torch.equal(again.take_residual(key), compressor.take_residual(key))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cuts", "shape"),
    [
        (Cuts(), (5, 3)),
        (Cuts(shards=4), (10, 7)),
        (Cuts(local=2, shards=3), (9, 4)),
        (Cuts(pieces=3, multiple=4), (3 * 2**18 // 8 + 5, 8)),
        (Cuts(pieces=2, local=2, shards=2), (2**19 // 4 + 3, 4)),
    ],
    ids=str,
)
def test_the_parts_of_a_tensor_tile_it(cuts: Cuts, shape: tuple[int, ...]) -> None:
    """Every part an engine cuts a tensor into (pieces, then node rows, then shards), placed by
    :meth:`Cuts.region`, covers the tensor exactly once, in the order the engine lays them out."""
    size = torch.Size(shape)
    keys, shapes = pieces.cut([0], [size], cuts.pieces, cuts.multiple, cuts.smallest)
    regions = []
    for key, piece in zip(keys, shapes, strict=True):
        for node, rows in enumerate(NodeShards((piece,), cuts.local).pieces[0] if cuts.local > 1 else [piece]):
            part = StateKey.of(key).of_node(node) if cuts.local > 1 else StateKey.of(key)
            bounds = chunk_bounds(math.prod(rows), cuts.shards)
            regions += [cuts.region(part.of_shard(j) if cuts.shards > 1 else part, size) for j in range(len(bounds))]
    covered = [i for start, stop in regions for i in range(start, stop)]
    assert sorted(covered) == list(range(math.prod(shape)))


def test_a_tensors_residual_comes_back_whole_from_its_parts() -> None:
    """Two-phase's shards in place, the reduced shard added on this rank's own: nothing left behind."""
    compressor = make_compressor("topk:ratio=0.5,ef=true")
    cuts, shape = Cuts(shards=2), torch.Size((4, 3))
    for j in range(2):
        compressor.compress(torch.randn(6), StateKey.of(9).of_shard(j))
    compressor.compress(torch.randn(6), StateKey.of(9).of_reduced(1))
    parts = {key: compressor.residuals[key].clone() for key in compressor.state_keys()}  # type: ignore[attr-defined]
    whole = take_residual(compressor, cuts, 9, shape)
    assert whole is not None and not compressor.state_keys()
    expected = torch.cat([parts[(9, 0)], parts[(9, 1)] + parts[(9, "reduced", 1)]]).view(shape)
    assert torch.equal(whole, expected)
    assert take_residual(compressor, cuts, 9, shape) is None  # nothing owed any more
