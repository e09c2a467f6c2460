"""The per-bucket pipeline: (error feedback) -> compress -> communicate -> decompress -> average.

- :mod:`~gradcomp.engine.spec`: :class:`HookSpec`, the compressor and the engine's options, parsed once.
- :mod:`~gradcomp.engine.pipeline`: :class:`Engine`, which averages a bucket of tensors over a group.
- :mod:`~gradcomp.engine.transport` and :mod:`~gradcomp.engine.packing`: a bucket's payloads in one
  collective (many tensors as one byte buffer, sizes first).
- :mod:`~gradcomp.engine.two_phase`: compressed reduce-scatter then all-gather, for ``gather``
  compressors at many ranks.
- :mod:`~gradcomp.engine.stats`: what each bucket cost, per step, and Chrome/Perfetto traces.
"""

from gradcomp.engine.pipeline import TWO_PHASE_FROM, Engine
from gradcomp.engine.spec import HookSpec, HookSpecLike

__all__ = ["TWO_PHASE_FROM", "Engine", "HookSpec", "HookSpecLike"]
