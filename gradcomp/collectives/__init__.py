"""Collectives implemented over torch.distributed point-to-point, beside the backend's own.

>>> from gradcomp import collectives
>>> collectives.all_reduce(tensor, "sum", algo="halving_doubling")          # in place, waits
>>> handle = collectives.all_reduce(tensor, "avg", algo="ring", async_op=True)
>>> handle.wait(); handle.traffic.sent                                      # exact bytes this rank sent

All-reduce algorithms (``ALGORITHMS``): ``native`` (the backend's own), ``ring``, ``tree``,
``halving_doubling`` and ``hierarchical`` (``local_size`` ranks per group). Operators: sum, avg, min,
max, product. Every call, synchronous or not, runs on one ordered worker thread
(:mod:`gradcomp.collectives.executor`); results are bitwise identical on every rank.
See ``docs/collectives.md`` for the algorithms, their costs, and when to choose which.
"""

from gradcomp.collectives.api import (
    ALGORITHMS,
    FLAT_ALGORITHMS,
    all_gather,
    all_gatherv,
    all_reduce,
    all_to_all,
    all_to_allv,
    broadcast,
    reduce_scatter,
)
from gradcomp.collectives.executor import Handle
from gradcomp.collectives.link import Traffic
from gradcomp.collectives.ops import ReduceOp

__all__ = [
    "ALGORITHMS",
    "FLAT_ALGORITHMS",
    "Handle",
    "ReduceOp",
    "Traffic",
    "all_gather",
    "all_gatherv",
    "all_reduce",
    "all_to_all",
    "all_to_allv",
    "broadcast",
    "reduce_scatter",
]
