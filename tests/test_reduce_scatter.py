"""Compressed reduce-scatter (sharded data parallelism's reduction) on ranks simulated as threads:
each rank gets the sum of its shard, exactly when compression is lossless, bitwise the protocol's
reference otherwise (each peer's payload decompressed, in rank order, plus the rank's own shard);
error feedback conserves every shard's gradient over steps; two hops send L times fewer bytes
across nodes; the result is rounded once to a low-precision gradient's dtype."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from gradcomp.compressors import Compressor, Meta, make_compressor
from gradcomp.engine.reduce_scatter import reduce_scatter, reduce_scatter_two_hop
from tests.fake_group import ThreadGroup, ThreadTransport, on_threads

SHARD = 300  # elements per shard: not a multiple of the quantizers' chunks


def gradient(rank: int, world: int, step: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(world * SHARD, generator=generator).to(dtype)


def flat_on(world: int, spec: str, divisor: float, dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    def rank_body(exchange: ThreadTransport) -> dict[str, Any]:
        compressor = make_compressor(spec, seed=0, rank=exchange.rank)
        parts = gradient(exchange.rank, world, dtype=dtype).view(world, SHARD)
        out = torch.empty(SHARD, dtype=dtype)
        produced = reduce_scatter(compressor, parts, divisor, "m", exchange, out)
        return {"out": out, "produced": produced, "sent": exchange.sent_elements}

    return on_threads(world, rank_body)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("spec", ["none", "topk:ratio=1", "randomk:ratio=1,scale=false"])
def test_lossless_compression_gives_each_rank_the_average_of_its_shard(world: int, spec: str) -> None:
    """``sum`` (none, random-k of everything) and ``gather`` (top-k of everything) paths alike."""
    results = flat_on(world, spec, divisor=world)
    full = sum(gradient(r, world) / world for r in range(world))
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["out"], full[rank * SHARD : (rank + 1) * SHARD], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "spec", ["quantize:bits=4,rounding=nearest", "sign", "topk:ratio=0.05", "fp8:chunk=64", "threshold:tau=0.5"]
)
@pytest.mark.parametrize("world", [2, 3])
def test_each_peers_payload_is_decompressed_into_its_owners_shard(world: int, spec: str) -> None:
    """Bitwise the protocol's reference: rank j's shard is its own, divided, plus every peer's
    compression of shard j decompressed, in rank order (deterministic compressors)."""
    divisor = 2.5  # not the world size: FSDP's gradient divide factor may be anything
    results = flat_on(world, spec, divisor)
    for owner, result in enumerate(results):
        acc = torch.zeros(SHARD)
        peers = [s for s in range(world) if s != owner]
        compressors = {s: make_compressor(spec, seed=0, rank=s) for s in peers}
        payloads = [compressors[s].compress(gradient(s, world).view(world, SHARD)[owner] / divisor, ("m", owner))[0]
                    for s in peers]  # fmt: skip
        compressors[peers[0]].codec.decompress_sum(payloads, Meta(acc.shape, acc.dtype, SHARD), out=acc)
        acc += gradient(owner, world).view(world, SHARD)[owner] / divisor
        assert torch.equal(result["out"], acc), f"rank {owner}"


def test_a_low_precision_gradient_is_summed_in_float32_and_rounded_once() -> None:
    results = flat_on(4, "topk:ratio=1", divisor=4, dtype=torch.bfloat16)
    exact = sum(gradient(r, 4, dtype=torch.bfloat16).float() / 4 for r in range(4))
    for rank, result in enumerate(results):
        assert result["out"].dtype == torch.bfloat16
        # the peers' sum in rank order, then the own shard: in float32, then one rounding
        assert torch.allclose(result["out"].float(), exact[rank * SHARD : (rank + 1) * SHARD], rtol=2**-8, atol=0)


def test_fp16_sums_on_the_wire_within_its_rounding() -> None:
    """Each rank's cast (half an ulp of each addend) and the sum's rounding (half an ulp of it)."""
    results = flat_on(2, "fp16", divisor=2)
    full = sum(gradient(r, 2) / 2 for r in range(2))
    magnitude = sum((gradient(r, 2) / 2).abs() for r in range(2))
    for rank, result in enumerate(results):
        mine = slice(rank * SHARD, (rank + 1) * SHARD)
        assert ((result["out"] - full[mine]).abs() <= 2**-10 * magnitude[mine]).all()


@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.05,ef=true", "quantize:bits=2,ef=true", "randomk:ratio=0.2,scale=false,ef=true"]
)
def test_error_feedback_conserves_every_shard_over_steps(spec: str) -> None:
    """Over T steps, what a rank received for its shard plus what every peer still holds for it in
    its residual is the sum of the gradients: nothing compression drops is lost, only delayed."""
    world, steps = 3, 5

    def rank_body(exchange: ThreadTransport) -> dict[str, Any]:
        compressor = make_compressor(spec, seed=0, rank=exchange.rank)
        received = torch.zeros(SHARD)
        for step in range(steps):
            out, parts = torch.empty(SHARD), gradient(exchange.rank, world, step).view(world, SHARD)
            reduce_scatter(compressor, parts, world, "m", exchange, out)
            received += out
        residuals = {j: compressor.residuals.get(("m", j)) for j in range(world)}  # type: ignore[attr-defined]
        return {"received": received, "residuals": residuals}

    results = on_threads(world, rank_body)
    for owner in range(world):
        sent = sum(gradient(r, world, t)[owner * SHARD : (owner + 1) * SHARD] / world
                   for r in range(world) for t in range(steps))  # fmt: skip
        held = sum(results[r]["residuals"][owner] for r in range(world) if results[r]["residuals"][owner] is not None)
        if spec.startswith("randomk"):  # sum aggregation compresses its own shard too, with its residual
            assert all(results[r]["residuals"][owner] is not None for r in range(world))
        else:
            assert results[owner]["residuals"][owner] is None, "a rank's own shard never travels: no residual"
        torch.testing.assert_close(results[owner]["received"] + held, sent, rtol=1e-5, atol=1e-5)


def two_hop_on(nodes: int, local: int, spec: str, body: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
    """Every rank's result of a two-hop reduce-scatter, ranks as threads: an intra group per node,
    an inter group per local index."""
    world = nodes * local
    intra = [ThreadGroup(local) for _ in range(nodes)]
    inter = [ThreadGroup(nodes) for _ in range(local)]

    def rank_body(rank: int) -> dict[str, Any]:
        node, index = divmod(rank, local)
        inside, across = ThreadTransport(intra[node], index), ThreadTransport(inter[index], node)
        compressor = make_compressor(spec, seed=0, rank=rank)
        out = torch.empty(SHARD)
        produced = reduce_scatter_two_hop(compressor, gradient(rank, world), world, "m", inside, across, out)
        return {"out": out, "produced": produced, "inter_sent": across.sent_elements, "compressor": compressor}

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_body, range(world), timeout=60))


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("spec", ["none", "topk:ratio=1"])
def test_two_hops_of_lossless_compression_give_the_average(nodes: int, local: int, spec: str) -> None:
    world = nodes * local
    results = two_hop_on(nodes, local, spec)
    full = sum(gradient(r, world) / world for r in range(world))
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["out"], full[rank * SHARD : (rank + 1) * SHARD], rtol=1e-5, atol=1e-6)


def test_two_hops_send_local_size_times_fewer_bytes_across_nodes() -> None:
    """4-bit codes of fixed size: across nodes a rank sends N - 1 shards where one hop sends p - 1."""
    nodes, local, spec = 2, 3, "quantize:bits=4"
    world = nodes * local
    flat = flat_on(world, spec, divisor=world)
    hops = two_hop_on(nodes, local, spec)
    for rank in range(world):
        assert hops[rank]["inter_sent"] * (world - 1) == flat[rank]["sent"] * (nodes - 1)
        exact = sum(gradient(r, world) / world for r in range(world))[rank * SHARD : (rank + 1) * SHARD]
        error = (hops[rank]["out"] - exact).norm() / exact.norm()
        assert error < 0.3, f"rank {rank}: two 4-bit compressions, relative error {error:.3f}"


def test_two_hop_state_is_kept_per_hop_and_destination() -> None:
    results = two_hop_on(2, 2, "topk:ratio=0.1,ef=true")
    compressor: Compressor = results[0]["compressor"]
    keys = set(compressor.residuals)  # type: ignore[attr-defined]
    assert keys == {(("m", "intra"), 1), (("m", "inter"), 1)}, keys


def test_bad_shapes_are_refused() -> None:
    compressor = make_compressor("sign")

    def rank_body(exchange: ThreadTransport) -> None:
        with pytest.raises(ValueError, match="contiguous"):
            reduce_scatter(compressor, torch.zeros(3, 4), 1, "m", exchange, torch.zeros(4))
        with pytest.raises(ValueError, match="elements"):
            reduce_scatter(compressor, torch.zeros(2, 4), 1, "m", exchange, torch.zeros(3))

    on_threads(2, rank_body)
