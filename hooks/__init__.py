"""DDP communication hooks: thin adapters from DDP's ``GradBucket`` to gradcomp's engine.

>>> from gradcomp import hooks
>>> state, hook = hooks.make("topk:ratio=0.01,ef=true")   # any compressor spec
>>> ddp_model.register_comm_hook(state, hook)
>>> state = hooks.register(ddp_model, "powersgd:rank=4")  # the same, in one line

Specs are gradcomp compressor specs (``gradcomp compressors`` lists them), plus ``allreduce`` (the
gradient itself, as DDP's default) and ``noop`` (no communication at all: the compute floor, for
benchmarks; training with it does not average anything), with the engine's options (``algo``,
``aggregation``, ``seed``). ``HookSpec.parse`` checks one without a process group. torch's own hooks, as
baselines spelt ``torch:fp16`` and the like: :mod:`gradcomp.hooks.torch_hooks`. See ``docs/hooks.md``.
"""

from gradcomp.engine.spec import HookSpec
from gradcomp.hooks.ddp import HookState, make, register

__all__ = ["HookSpec", "HookState", "make", "register"]
