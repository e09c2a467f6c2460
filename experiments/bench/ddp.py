"""``gradcomp bench ddp``: DDP step time with gradcomp's hooks beside PyTorch's own, on a chosen network.

    gradcomp bench ddp --model mlp --ranks 2 --net loopback,1gbit --hooks "powersgd:rank=4;sign:ef=true"

Every rank builds one DDP copy of the model per variant (same initial weights), then runs them in
rounds: each round gives every variant ``steps / rounds`` training steps (forward, backward with
the hook's communication, SGD step) in an order rotated from round to round, so that the machine's
drift hits every variant alike. A step's time is the slowest rank's; each figure is the median over
the timed steps, after ``warmup`` untimed ones (DDP's bucket rebuild, PowerSGD's start, caches).

Variants: always ``noop`` (no communication: the compute floor) and ``torch:allreduce`` (DDP's
built-in C++ path); by default also torch's Python ``allreduce_hook`` (the same all-reduce through
the hook interface, which a gradcomp hook also goes through), ``fp16_compress_hook``, and
``powerSGD_hook`` (rank 4, error feedback, from step 2), spelt as everywhere else
(:mod:`gradcomp.hooks.torch_hooks`: ``torch:allreduce_hook``, ``torch:fp16``, ``torch:powersgd:rank=4``).
PowerSGD runs in ranks of its own: on gloo it would hang whenever the model has more than one bucket
(it issues its second all-reduce from the first one's callback: the rule "one ordered path" of
``docs/architecture.md``); gradcomp's wrapper refuses that case, and the table reports it instead of
taking the other figures with it.

Models and data come from the ``synthetic`` task (random data: the loss means nothing, the step
time does): each preset is one of its models at a batch size. ``--model pkg.module:factory`` times a
user's own model instead: ``factory()`` builds it, and it trains on random inputs of
``--input-shape`` (integers below ``--input-high`` when given, for token models) against the mean
square of its output.

Beside the step times, a second table shows where each gradcomp hook's time goes (the engine's own
records, medians per step): compression and decompression, the wall time of its collectives, and
the tail that backward could not hide.

Wire bytes are what one rank sends per step: measured by gradcomp where it moves the bytes itself
(a padded all-gather on the backend counts its ring's p - 1 frames), else the ring all-reduce's
2 (p - 1) / p x payload (gloo's and NCCL's all-reduce are rings); for torch's hooks the payload is
what they hand to the backend (``TorchHookState.steps``).

The parts, shared with ``gradcomp bench fsdp``: :mod:`gradcomp.experiments.bench` lists them.
"""

from __future__ import annotations

import argparse

from gradcomp.experiments.bench.command import add_parser
from gradcomp.experiments.bench.modes import DDP


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp bench ddp`` (an entry point of the ``gradcomp.bench`` group)."""
    add_parser(commands, DDP, "DDP step time: gradcomp hooks beside torch's, per network")
