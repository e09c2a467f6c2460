"""Infrequent synchronization: local SGD and DiLoCo (and Streaming DiLoCo), through any compressor.

>>> from gradcomp import sync
>>> outer = sync.DiLoCo(model, inner, every=50, spec="quantize:bits=4,ef=true", fragments=4, delay=2)
>>> for batch in data:
...     loss(model, batch).backward(); inner.step(); inner.zero_grad()
...     outer.step()                                      # every rank, after every inner step

- :mod:`~gradcomp.sync.spec`: :class:`SyncSpec`, how often and how replicas synchronize, parsed once.
- :mod:`~gradcomp.sync.fragments`: the parameters in fragments, and when each synchronizes.
- :mod:`~gradcomp.sync.synchronizer`: :class:`Synchronizer` (and :class:`LocalSGD`, :class:`DiLoCo`),
  which averages outer gradients through the engine and takes the outer step, and
  :class:`SyncStepStats`, what each inner step's synchronizations cost.
- :mod:`~gradcomp.sync.fault_tolerant`: the same on torchft's ``Manager`` (replica groups that
  survive a lost one; ``pip install gradcomp[torchft]``).

Each rank holds a full replica; nothing here knows DDP. See ``docs/local-sgd.md``.
"""

from gradcomp.sync.spec import KINDS, SyncSpec, SyncSpecLike
from gradcomp.sync.synchronizer import DiLoCo, LocalSGD, Synchronizer, SyncStepStats

__all__ = ["KINDS", "DiLoCo", "LocalSGD", "SyncSpec", "SyncSpecLike", "SyncStepStats", "Synchronizer"]
