"""Per-chunk views of a flat tensor, without padding copies.

A flat tensor of n elements splits into ``n // chunk`` full chunks, viewed as one 2-D tensor, and
at most one shorter tail chunk, viewed as a 1-row 2-D tensor. Per-chunk statistics and per-chunk
affine maps are then two vectorized operations at most, whatever n is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from gradcomp.compressors import fusion


def num_chunks(numel: int, chunk: int) -> int:
    """How many chunks (the last one possibly short) ``numel`` elements make."""
    return -(-numel // chunk)


def parts(flat: Tensor, chunk: int) -> Iterator[tuple[Tensor, slice]]:
    """Yield (2-D view, slice of chunk indices) for the full chunks and for the tail chunk."""
    full = flat.numel() // chunk
    if full:
        yield flat[: full * chunk].view(full, chunk), slice(0, full)
    if flat.numel() > full * chunk:
        yield flat[full * chunk :].view(1, -1), slice(full, full + 1)


def reduce(flat: Tensor, chunk: int, op: Callable[[Tensor], Tensor]) -> Tensor:
    """Per-chunk reduction: ``op`` maps a (rows, cols) view to a (rows,) tensor."""
    results = [op(view) for view, _ in parts(flat, chunk)]
    if not results:
        return torch.empty(0, dtype=flat.dtype, device=flat.device)
    return results[0] if len(results) == 1 else torch.cat(results)


def reduce_rows(flat: Tensor, chunk: int, indices: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
    """``reduce`` over the chunks at ``indices`` only (sorted, as ``torch.nonzero`` gives them):
    for a slower, exact reduction of the few chunks that need it."""
    full = flat.numel() // chunk
    inside = indices[indices < full]
    results = [op(flat[: full * chunk].view(full, chunk).index_select(0, inside))] if inside.numel() else []
    if inside.numel() < indices.numel():  # the tail chunk
        results.append(op(flat[full * chunk :].view(1, -1)))
    return torch.cat(results) if results else torch.empty(0, dtype=flat.dtype, device=flat.device)


def amax_abs(flat: Tensor, chunk: int) -> Tensor:
    """max |x| per chunk, without materialising |x| (two cheap reductions instead of a 4-byte pass;
    for the whole chunks one fused pass where :mod:`~gradcomp.compressors.fusion` compiles: exact,
    so bitwise the same)."""
    count = flat.numel() // chunk
    if count and _AMAX_ABS.may_run(flat.device):
        peaks = torch.empty(num_chunks(flat.numel(), chunk), dtype=flat.dtype, device=flat.device)
        if _AMAX_ABS.run(flat[: count * chunk].view(count, chunk), peaks[:count]):
            if peaks.numel() > count:  # a short last chunk
                peaks[count:] = _largest_magnitude(flat[count * chunk :].view(1, -1))
            return peaks
    return reduce(flat, chunk, _largest_magnitude)


def _largest_magnitude(rows: Tensor) -> Tensor:
    # abs: max(+0, -0) may give either zero (ATen's and Inductor's differ); a peak is +0 either way
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()).abs()


def _amax_abs_fused(rows: Tensor, out: Tensor) -> None:
    out.copy_(_largest_magnitude(rows))


_AMAX_ABS = fusion.Kernel(_amax_abs_fused, "max |x|")
