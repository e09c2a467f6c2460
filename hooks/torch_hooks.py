"""PyTorch's own DDP communication hooks, spelt ``torch:NAME[:options]``: the anchors of every comparison.

::

    torch:allreduce                  DDP's built-in all-reduce (no hook registered: DDP's C++ path)
    torch:allreduce_hook             the same all-reduce through torch's Python hook interface
    torch:fp16, torch:bf16           fp16_compress_hook, bf16_compress_hook
    torch:powersgd:rank=4            powerSGD_hook (options: :class:`PowerSGDOptions`)

Training runs, sweeps and ``gradcomp bench ddp`` take these wherever they take a gradcomp hook spec,
so a comparison always has what a user would otherwise use beside gradcomp's methods.
:func:`register` attaches one to a DDP model and returns a :class:`TorchHookState`, which records
what the hook hands to the backend per step (the same per-step records as a gradcomp hook's
``steps()``, without compression times: torch's hooks do not measure them) and saves and restores
PowerSGD's state with ``torch.load(..., weights_only=True)``.

torch's PowerSGD hook hangs on gloo when DDP splits the gradients into more than one bucket (its
second all-reduce is issued from the first one's completion callback): the hook refuses that case at
its first compressing step, on every rank alike, with an error that says so, instead of hanging.

torch's PowerSGD keeps its residuals and warm-start factors per bucket, flat, in the order of the
bucket's parameters, and DDP lays a bucket out in one order on a model's first step and in another
after it (its bucket rebuild). A run resumed in a new DDP model would add residuals to the wrong
parameters on its first step; :class:`TorchHookState` follows each bucket's layout and reorders the
state when it changes, so that a resumed run continues with the state it saved. Not bitwise: the
hook multiplies matrices in place in the bucket's memory, and on the other layout their alignment
differs, which changes the last bits of the products on that one step (1e-8 on the digits MLP);
without ``warm_start`` that step also draws its random factors in the other order. ``batched=true``
cannot follow a layout change at all (its factors are of the whole bucket as one matrix): refused.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at run time.
import collections
import dataclasses
import math
import os
import typing
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from gradcomp.collectives.cost_model import ring_traffic
from gradcomp.compressors import parse_spec
from gradcomp.engine.spec import HookSpec, add_other_kind
from gradcomp.engine.stats import StepStats, newest, write_trace
from gradcomp.hooks.ddp import check_saved
from gradcomp.options import closest, format_value, options_from, split_spec
from gradcomp.state import TrainingHookState

if typing.TYPE_CHECKING:
    from gradcomp.cost.step import Method

PREFIX = "torch:"
HOOKS = {
    "allreduce": "DDP's built-in all-reduce (no hook registered)",
    "allreduce_hook": "the same all-reduce through torch's Python hook interface",
    "fp16": "torch's fp16_compress_hook",
    "bf16": "torch's bf16_compress_hook",
    "powersgd": "torch's powerSGD_hook (options: rank, start, ef, warm_start, min_compression_rate, batched)",
}
"""torch's hooks by name (after ``torch:``), each with what it is."""
NAMES = tuple(HOOKS)
BUILTIN = "allreduce"
"""DDP's own all-reduce: nothing is registered."""
Hook = Callable[["TorchHookState", GradBucket], torch.futures.Future[Tensor]]
RECORDS = 10_000
"""Steps a :class:`TorchHookState` keeps (its memory stays flat however long the run)."""

add_other_kind(
    PREFIX.rstrip(":"),
    "torch's hooks (torch:fp16, torch:powersgd, ...) are DDP's own, not gradcomp's engine's: attach one "
    "with gradcomp.hooks.register(ddp_model, 'torch:fp16') (gradcomp.hooks.parse checks it); here take "
    "gradcomp's (fp16, powersgd, ...)",
    {PREFIX + name: what for name, what in HOOKS.items()},
)


@dataclasses.dataclass(frozen=True)
class PowerSGDOptions:
    """Options of ``torch:powersgd``, each one of ``PowerSGDState``'s arguments."""

    rank: int = 1
    """``matrix_approximation_rank``."""
    start: int = 2
    """``start_powerSGD_iter``: plain all-reduce before this step. torch's default is 1000; here it
    is 2 (the least torch allows with error feedback or warm start), as gradcomp's powersgd, which
    compresses from the first step: set ``start=N`` for torch's recommended warm-up."""
    ef: bool = True
    """``use_error_feedback``."""
    warm_start: bool = True
    """``warm_start``: reuse the previous step's Q."""
    min_compression_rate: float = 2.0
    """``min_compression_rate``: a tensor compressed less than this goes uncompressed."""
    batched: bool = False
    """``batched_powerSGD_hook`` (the whole bucket as one matrix) instead of ``powerSGD_hook``."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.start < 0 or ((self.ef or self.warm_start) and self.start < 2):
            raise ValueError(f"start must be >= 2 with ef or warm_start (torch's rule), got {self.start}")
        if not self.min_compression_rate > 0:
            raise ValueError(f"min_compression_rate must be > 0, got {self.min_compression_rate}")


@dataclasses.dataclass(frozen=True)
class TorchHookSpec:
    """A parsed ``torch:`` spec: which of torch's hooks, and PowerSGD's options."""

    name: str
    powersgd: PowerSGDOptions | None = None

    @classmethod
    def parse(cls, text: str) -> "TorchHookSpec":
        """``torch:NAME[:key=value,...]``; a ValueError names what is wrong and the valid choices."""
        if not is_torch_spec(text):
            raise ValueError(f"a torch hook spec starts with {PREFIX!r}, got {text!r}")
        name, options = split_spec(text.strip()[len(PREFIX) :])
        if name not in NAMES:
            match = closest(name, NAMES)
            hint = f" (did you mean {PREFIX + match!r}?)" if match else ""
            raise ValueError(f"unknown torch hook {name!r}{hint}; valid: {', '.join(PREFIX + n for n in NAMES)}")
        if name == "powersgd":
            return cls(name, options_from(PowerSGDOptions, options, "torch:powersgd"))
        if options:
            raise ValueError(f"torch:{name} takes no options, got {sorted(options)}")
        return cls(name)

    def __str__(self) -> str:
        """The canonical text: the name, then each PowerSGD option that differs from its default."""
        text = PREFIX + self.name
        if self.powersgd is None:
            return text
        changed = [
            f"{f.name}={format_value(getattr(self.powersgd, f.name))}"
            for f in dataclasses.fields(self.powersgd)
            if getattr(self.powersgd, f.name) != f.default
        ]
        return text + (":" + ",".join(changed) if changed else "")

    def cost_method(self) -> "Method":
        """How the cost model (:mod:`gradcomp.cost.step`) prices this hook: the all-reduce hooks send
        the bucket as it is, the casts run the same kernel as gradcomp's ``fp16``/``bf16``, and
        PowerSGD is priced as gradcomp's ``powersgd`` of the same rank and error feedback."""
        from gradcomp.cost.step import Method  # here: the cost model is not a hook's import

        if self.name in ("allreduce", "allreduce_hook"):
            compressor = parse_spec("none")
        elif self.name in ("fp16", "bf16"):
            compressor = parse_spec(self.name)
        else:
            options = self.powersgd or PowerSGDOptions()
            compressor = parse_spec(
                ("powersgd", {"rank": options.rank, "warm_start": options.warm_start, "ef": options.ef})
            )
        return Method(str(self), HookSpec(compressor))


def is_torch_spec(text: object) -> bool:
    """Whether ``text`` names one of torch's hooks (``torch:...``) rather than a gradcomp hook."""
    return isinstance(text, str) and text.strip().startswith(PREFIX)


class TorchHookState(TrainingHookState):
    """One of torch's hooks on a DDP model, and what it sent (:meth:`steps`), as every hook's state
    (:class:`~gradcomp.state.TrainingHookState`).

    Per step, ``input_bytes`` is the gradient handed to the hook and ``payload_bytes`` what the hook
    hands to the backend's all-reduce: the buffer for the all-reduces, half of it for the casts, and for
    PowerSGD its own count of the elements it sends (factors and the tensors it leaves uncompressed;
    the whole buffer before ``start``). ``sent_bytes`` is None, and ``sent_estimate`` what the
    backend's ring moves, ``2 (p - 1) / p`` of the payload, as for gradcomp's native all-reduce.
    ``buckets`` and the phases' seconds (``compress_s``, ``communicate_s``, ``decompress_s``,
    ``tail_s``) are None: torch's hooks neither count nor time them.
    """

    def __init__(self, spec: TorchHookSpec, model: torch.nn.parallel.DistributedDataParallel, seed: int) -> None:
        self.spec = spec
        parameters = list(model.parameters())
        self._index = {id(p): i for i, p in enumerate(parameters)}
        self._shapes = [tuple(p.shape) for p in parameters]
        self._layouts: dict[int, list[int]] = {}
        """Per bucket, the parameters (indices) in the order PowerSGD's state for it is laid out."""
        self.group = model.process_group
        self.world = dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        self.error: BaseException | None = None
        """The error that stopped training (the refused PowerSGD case), raised in place of DDP's text."""
        self.records: collections.deque[StepStats] = collections.deque(maxlen=RECORDS)
        self._steps = 0
        self._bucket_bytes = [0, 0]  # input, payload of the step in progress
        self.powersgd: Any = None
        options = spec.powersgd
        if options is not None:
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=self.group,
                matrix_approximation_rank=options.rank,
                start_powerSGD_iter=options.start,
                min_compression_rate=options.min_compression_rate,
                use_error_feedback=options.ef,
                warm_start=options.warm_start,
                random_seed=seed,
            )

    def steps_since(self, first: int) -> list[StepStats]:
        return newest(self.records, first)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """A trace without events: torch's hooks time nothing (a profiler's trace shows their collectives)."""
        write_trace([], path, dist.get_rank())

    def state_dict(self) -> dict[str, Any]:
        """The spec, world size and PowerSGD's state (iteration, residuals, factors, its generator), as
        plain tensors and numbers: loadable with ``torch.load(..., weights_only=True)``."""
        state: dict[str, Any] = {"spec": str(self.spec), "world_size": self.world}
        ps = self.powersgd
        if ps is not None:
            kind, keys, position, has_gauss, cached = ps.rng.get_state()
            state["powersgd"] = {
                "iter": ps.iter,
                # copies: the hook updates its memories in place, and a saved state must not move
                "error_dict": {b: t.clone() for b, t in ps.error_dict.items()},
                "p_memory_dict": {b: t.clone() for b, t in ps.p_memory_dict.items()},
                "q_memory_dict": {b: t.clone() for b, t in ps.q_memory_dict.items()},
                "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                "total_numel_before_compression": ps.total_numel_before_compression,
                "total_numel_after_compression": ps.total_numel_after_compression,
                "next_stats_report": ps.next_stats_report,
                "layouts": {b: list(layout) for b, layout in self._layouts.items()},
            }  # fmt: skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a hook of the same spec and world size."""
        check_saved(state, str(self.spec), self.world, "torch")
        ps = self.powersgd
        if ps is None:
            return
        saved_ps = state["powersgd"]
        ps.iter = int(saved_ps["iter"])
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            setattr(ps, name, {int(k): v for k, v in saved_ps[name].items()})
        rng = saved_ps["rng"]
        ps.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["position"], rng["has_gauss"],
                          rng["cached_gaussian"]))  # fmt: skip
        ps.total_numel_before_compression = int(saved_ps["total_numel_before_compression"])
        ps.total_numel_after_compression = int(saved_ps["total_numel_after_compression"])
        ps.next_stats_report = int(saved_ps["next_stats_report"])
        self._layouts = {int(b): [int(i) for i in layout] for b, layout in saved_ps["layouts"].items()}

    def _follow_layout(self, bucket: GradBucket) -> None:
        """Reorder PowerSGD's state of ``bucket`` if DDP laid the bucket out otherwise than the state is."""
        b = bucket.index()
        layout = [self._index[id(p)] for p in bucket.parameters()]
        held = self._layouts.setdefault(b, layout)
        ps = self.powersgd
        if held == layout or (b not in ps.error_dict and b not in ps.q_memory_dict):
            self._layouts[b] = layout
            return
        if sorted(held) != sorted(layout):
            raise ValueError(
                f"DDP's bucket {b} holds other parameters than when torch's PowerSGD state was made: the state "
                "cannot follow it (a run resumes exactly at the same world size and bucket sizes)"
            )
        options = self.spec.powersgd
        assert options is not None
        if b in ps.error_dict:
            sizes = {i: math.prod(self._shapes[i]) for i in layout}
            ps.error_dict[b] = _reorder(ps.error_dict[b], [(i, sizes[i]) for i in held], layout)
        if b in ps.q_memory_dict:
            if options.batched:
                raise ValueError(
                    "torch's batched PowerSGD cannot continue exactly once DDP lays its bucket out anew (its "
                    "factors are of the whole bucket as one matrix): resume with torch:powersgd, or start over"
                )
            order = [i for i, _ in self._q_pieces(layout)]
            ps.q_memory_dict[b] = _reorder(ps.q_memory_dict[b], self._q_pieces(held), order)
        self._layouts[b] = layout

    def _q_pieces(self, layout: list[int]) -> list[tuple[int, int]]:
        """(parameter, size) of each warm-start factor Q in PowerSGD's memory for a bucket laid out as
        ``layout``: the compressed matrices grouped by shape in order of first appearance, as
        ``powerSGD_hook`` lays them out."""
        options = self.spec.powersgd
        assert options is not None
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i in layout:
            n = self._shapes[i][0]
            m = math.prod(self._shapes[i]) // n
            rank = min(n, m, options.rank)
            if powerSGD_hook._should_compress(n, m, rank, options.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((i, m * rank))
        return [piece for pieces in groups.values() for piece in pieces]

    # -- what the hook hands to the backend, per step --------------------------------------------

    def _bucket(self, bucket: GradBucket, payload_bytes: int) -> None:
        buffer = bucket.buffer()
        self._bucket_bytes[0] += buffer.numel() * buffer.element_size()
        self._bucket_bytes[1] += payload_bytes
        if bucket.is_last():
            self._end_step()

    def _end_step(self) -> None:
        input_bytes, payload_bytes = self._bucket_bytes
        self.records.append(StepStats(
            self._steps, buckets=None, input_bytes=input_bytes, payload_bytes=payload_bytes, sent_bytes=None,
            received_bytes=None, sent_estimate=payload_bytes * ring_traffic(self.world), compress_s=None,
            communicate_s=None, decompress_s=None, host_reads=None, tail_s=None,
        ))  # fmt: skip
        self._bucket_bytes = [0, 0]
        self._steps += 1


def register(
    model: torch.nn.parallel.DistributedDataParallel,
    spec: TorchHookSpec | str,
    seed: int = 0,
    scaler: torch.amp.GradScaler | None = None,
) -> TorchHookState:
    """Attach torch's hook ``spec`` to ``model`` (on the group it communicates on) and return its state.

    ``torch:allreduce`` registers nothing (DDP's built-in path); its steps are recorded by a forward
    pre-hook on ``model`` (each training forward outside ``no_sync`` is a step), each sending every gradient that
    requires one. ``seed`` seeds PowerSGD's generator (as a gradcomp hook's ``seed``). ``scaler`` is
    taken as gradcomp's hooks take it, and has nothing to follow in torch's casts and all-reduce (they
    keep nothing between steps); torch's PowerSGD keeps its error feedback at the scale it was made in
    (a warning says so: gradcomp's ``powersgd`` follows it).
    """
    parsed = spec if isinstance(spec, TorchHookSpec) else TorchHookSpec.parse(spec)
    if parsed.powersgd is not None:
        _check_powersgd(parsed.powersgd, model)
        if scaler is not None and scaler.is_enabled():
            warnings.warn(
                f"{parsed}: torch's PowerSGD keeps its error feedback at the loss scale it was made in; when the "
                "scaler changes the scale, the residuals are added at the wrong size (gradcomp's powersgd:ef=true "
                "follows the scale)",
                stacklevel=2,
            )
    state = TorchHookState(parsed, model, seed)
    if parsed.name == BUILTIN:
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

        def count_step(module: torch.nn.Module, inputs: Any) -> None:
            if torch.is_grad_enabled() and module.training and module.require_backward_grad_sync:  # not no_sync
                state._bucket_bytes = [gradient_bytes, gradient_bytes]
                state._end_step()

        model.register_forward_pre_hook(count_step)
        return state
    model.register_comm_hook(state, _HOOKS[parsed.name])
    return state


def _check_powersgd(options: PowerSGDOptions, model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Refuse, before the first step, what torch's PowerSGD hooks cannot run here."""
    if options.batched and not _batched_runs():
        raise ValueError(
            f"torch {torch.__version__}'s batched_powerSGD_hook fails at its first compressed step (its "
            "_orthogonalize takes a batch of matrices, and the batched hook hands it one: AssertionError): "
            "use torch:powersgd without batched, or gradcomp's powersgd"
        )
    if getattr(model, "find_unused_parameters", False) and dist.get_backend(model.process_group) == "gloo":
        raise ValueError(
            "torch's PowerSGD hook aborts on gloo with find_unused_parameters=True (DDP's own collective for "
            "the unused parameters meets the hook's second all-reduce, which it issues from the first one's "
            "callback, in another order on each rank: 'Received data size doesn't match'; torch's own "
            "powerSGD_hook does too): use gradcomp's powersgd, or NCCL"
        )


def _batched_runs() -> bool:
    """Whether this torch's batched PowerSGD can orthogonalize its one matrix (torch 2.13's cannot)."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(4, 2))
    except AssertionError:
        return False
    return True


def _forwarding(hook: Callable[[Any, GradBucket], torch.futures.Future[Tensor]], element_bytes: int | None) -> Hook:
    """torch's ``hook`` (called with the state's group), recording a payload of ``element_bytes`` per
    gradient element (None: the gradient's own size)."""

    def forward(state: TorchHookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        state._bucket(bucket, buffer.numel() * (element_bytes or buffer.element_size()))
        return hook(state.group, bucket)

    return forward


def _powersgd(state: TorchHookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    ps, options = state.powersgd, state.spec.powersgd
    assert options is not None
    buffer = bucket.buffer()
    compressing = ps.iter >= ps.start_powerSGD_iter
    if compressing and state.backend == "gloo" and (bucket.index() > 0 or not bucket.is_last()):
        state.error = ValueError(
            "torch's PowerSGD hook hangs on gloo when DDP splits the gradients into more than one bucket (it "
            "issues its second all-reduce from the first one's callback), and this model has several: use "
            "gradcomp's powersgd, a larger bucket_cap_mb, or NCCL"
        )
        raise state.error
    if compressing:
        state._follow_layout(bucket)
    before = ps.total_numel_after_compression
    hook = powerSGD_hook.batched_powerSGD_hook if options.batched else powerSGD_hook.powerSGD_hook
    future = hook(ps, bucket)
    sent = (ps.total_numel_after_compression - before) if compressing else buffer.numel()
    state._bucket(bucket, sent * buffer.element_size())
    return future


def _reorder(flat: Tensor, pieces: list[tuple[int, int]], order: list[int]) -> Tensor:
    """``flat``, the concatenation of ``pieces`` ((key, size) in memory order), rearranged to ``order``
    of the keys (the pieces not in ``order`` are dropped)."""
    chunks = dict(zip((key for key, _ in pieces), flat.split([size for _, size in pieces]), strict=True))
    return torch.cat([chunks[key] for key in order if key in chunks])


_HOOKS: dict[str, Hook] = {
    "allreduce_hook": _forwarding(default_hooks.allreduce_hook, None),
    "fp16": _forwarding(default_hooks.fp16_compress_hook, 2),
    "bf16": _forwarding(default_hooks.bf16_compress_hook, 2),
    "powersgd": _powersgd,
}
