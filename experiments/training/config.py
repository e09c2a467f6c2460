"""The settings of one training run: a frozen dataclass, checked when it is made.

The same fields are the options of ``experiments/train.py`` (``--batch-size`` for ``batch_size``),
the keys of a sweep config's ``[sweep]`` table, and the ``config`` of a run's ``run.json``. A config
keeps what was said; what the run uses and records is derived from it, :attr:`TrainConfig.effective`:
the hook spec parsed once into its type, with the run's momentum and clipping moved into it through
``dataclasses.replace`` (never by editing the spec's text), and the hook and sync in canonical text.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from gradcomp import hooks
from gradcomp.collectives.hierarchical import check_local_size
from gradcomp.compressors.registry import NO_FEEDBACK
from gradcomp.experiments.tasks import build_task, parse_task
from gradcomp.experiments.training.optim import SCHEDULES, parse_optimizer
from gradcomp.experiments.training.parallel import PARALLELS, check_nodes, node_size
from gradcomp.hooks.compressed_adamw_spec import is_compressed_adamw_spec
from gradcomp.options import convert, format_value, split_spec
from gradcomp.sync import SyncSpec

BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. ``steps`` or ``epochs`` (not both) says how long (the command line: 200 steps
    unless it says); everything else has a default."""

    task: str = "digits"
    """Task spec: digits, signal, charlm, synthetic or classify, with options (``signal:samples=50000``)."""
    model: str | None = None
    """Model name (``gradcomp.experiments.models``); default: the task's first."""
    data: str | None = None
    """Your own dataset (.pt/.npz for classify, a text file for charlm)."""
    steps: int | None = None
    """Optimizer steps in all (the learning-rate schedule spans them)."""
    epochs: float | None = None
    """Or: passes over the training set."""
    batch_size: int = 64
    """Global batch per step, split evenly over the ranks (so runs at any world size see the same data)."""
    optimizer: str = "sgd"
    """sgd, nesterov, adam or adamw (``gradcomp.experiments.training.optim``), or AdamW whose momentum
    travels compressed after a warm-up (1-bit Adam's method, ``gradcomp.hooks.CompressedAdamW``):
    compressed-adamw:freeze=100,carrier=sign:ef=true,beta1=0.9,beta2=0.999,eps=1e-8,bound=1,variance_every=0,
    variance_carrier=bf16 (the defaults; freeze: warm-up steps, after which the variance is frozen;
    carrier: the hook spec the momentum travels by; bound: the largest step per coordinate after the
    freeze, in units of lr; variance_every: N > 0 to go on learning the variance, each rank from its own
    gradients, averaged every N steps through variance_carrier; freeze=auto: freeze once the variance
    has settled, its denominator moving less than settle=0.1 in 10 steps; scaled=true: compress in
    Adam's units, each exchange divided by AdamW's denominator). The hook then averages the gradient
    until the freeze (allreduce, or a spec without error feedback: quantize:bits=4 sends the warm-up in
    4 bits) and sends nothing after it; DDP only (no fsdp, no sync)."""
    lr: float = 0.1
    """Peak learning rate."""
    momentum: float = 0.0
    """SGD momentum (nesterov: 0.9 if 0). A gradcomp hook with ``momentum=true`` takes it over (DGC's
    momentum correction, before compression; nesterov too): the optimizer then runs without it."""
    weight_decay: float = 0.0
    clip: float = 0.0
    """Clip gradients to this L2 norm (0: off): the averaged gradients, before the optimizer step; with
    a hook that has error feedback, each rank's share instead, before compression (the hook's
    ``clip``: DGC's local clipping, per tensor, scaled by the world size)."""
    schedule: str = "constant"
    """Learning-rate schedule after warmup: constant, cosine (to 0) or linear (to 0)."""
    warmup_steps: int = 0
    """Steps of linear warmup to ``lr``."""
    seed: int = 0
    """Seeds the model, the data order and (unless the spec sets one) the hook's generators."""
    hook: str = "allreduce"
    """DDP communication hook spec (``gradcomp.hooks.make``): allreduce, noop, fp16, topk:ratio=0.01,ef=true,
    ..., or one of torch's own hooks (``gradcomp.hooks.torch_hooks``): torch:allreduce (DDP's built-in),
    torch:fp16, torch:bf16, torch:powersgd:rank=4; kept in its canonical text, which names the run's
    directory in sweeps. With ``parallel`` fsdp, a sharded spec (``gradcomp.hooks.parse_sharded``):
    none, noop, quantize:bits=4,ef=true, ..., or FSDP2's own: torch:reduce_scatter, torch:bf16, torch:fp16.
    With ``parallel`` hsdp, the spec the node's shards are averaged by across nodes
    (``gradcomp.hooks.parse_hybrid``: allreduce, quantize:bits=4,ef=true, ...), or FSDP2's own HSDP:
    torch:reduce_scatter, torch:bf16, torch:fp16."""
    sync: str = "none"
    """none (the hook averages gradients every step) or infrequent synchronization (``gradcomp.sync``):
    localsgd:every=8 (the replicas averaged every 8 steps), diloco:every=50 (DiLoCo's outer Nesterov
    step), with fragments=, delay= and mix= for Streaming DiLoCo. Each rank then trains its own replica,
    and ``hook`` is the gradcomp spec the outer gradients travel by (allreduce, quantize:bits=4,ef=true,
    ...). Kept in its canonical text."""
    parallel: str = "ddp"
    """ddp (a replica per rank; the hook averages gradients), fsdp (FSDP2: parameters, gradients and
    optimizer state sharded; the hook reduce-scatters gradients) or hsdp (FSDP2 inside each node, a
    replica per node: the hook averages the node's shards across nodes; the node size is the
    launcher's, an emulated cluster's ``network = "nodes=NxL,..."`` or torchrun's)."""
    backend: str = "gloo"
    """gloo (CPU) or nccl (GPU: one device per rank)."""
    ranks: int = 1
    """Processes to start on this machine (ignored under torchrun, which says how many there are)."""
    network: str = "loopback"
    """Network profile the ranks run behind (gradcomp.netem): loopback, 1gbit, 100mbit-2ms, ..."""
    threads: int = 1
    """torch intra-op threads per rank started here."""
    eval_every: int = 0
    """Evaluate every this many steps (0: ten times per run); always at the start and the end."""
    log_every: int = 10
    """Write training scalars every this many steps."""
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: only at the end or at ``stop_at``)."""
    stop_at: int | None = None
    """Stop at this step with a checkpoint, as if interrupted (status "stopped"); resume later."""
    out: str = "runs/train"
    """Directory of the run: TensorBoard events, run.json, checkpoint.pt."""
    checkpoint: str | None = None
    """Checkpoint file; None: OUT/checkpoint.pt."""
    resume: str | None = None
    """Resume from this checkpoint; ``auto``: from the checkpoint file if it exists (else start over)."""
    overwrite: bool = False
    """Replace the run that OUT holds (its events, checkpoint and run.json); without it, or resume,
    a directory holding another run is refused."""
    timeout: float = 3600.0
    """Seconds the whole run may take when its ranks are started here."""
    group_timeout: float = 300.0
    """Seconds any one collective may take before the run fails (a dead peer)."""

    def __post_init__(self) -> None:
        """Checks what was said, never rewrites it: the settings the run uses are :attr:`effective`."""
        family, _ = parse_task(self.task)
        if self.model is not None and self.model not in family.models:
            raise ValueError(f"task {family.name!r} has no model {self.model!r}; valid: {', '.join(family.models)}")
        if self.data is not None:
            if family.data == "none":
                raise ValueError(f"task {family.name!r} takes no data file (classify and charlm do)")
            if not os.path.isfile(self.data):
                raise ValueError(f"data file {self.data!r} does not exist")
        elif family.data == "required":
            raise ValueError(f"task {family.name!r} needs a data file (data=PATH)")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give steps or epochs (one of them)")
        _positive(self, "steps", "epochs", "batch_size", "ranks", "threads", "log_every", "timeout", "group_timeout")
        _positive(self, "lr", strict=True)
        _positive(
            self, "momentum", "weight_decay", "clip", "warmup_steps", "eval_every", "checkpoint_every", strict=False
        )
        if self.momentum >= 1:
            raise ValueError(f"momentum must be < 1, got {self.momentum}")
        if self.stop_at is not None and self.stop_at < 1:
            raise ValueError(f"stop_at must be >= 1, got {self.stop_at}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in 0..2**31-1, got {self.seed}")
        parse_optimizer(self.optimizer)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("backend", self.backend, BACKENDS)
        _choice("parallel", self.parallel, PARALLELS)
        if self.batch_size % self.ranks:
            raise ValueError(f"batch_size {self.batch_size} does not split evenly over {self.ranks} ranks")
        try:
            hook = self._hook
        except ValueError as error:
            raise ValueError(f"hook {self.hook!r}: {error}") from None
        # auto's candidates warm up on the hook's clock, as a plain hook does
        warmup = max(getattr(spec, "warmup", 0) for spec in getattr(hook, "hook_specs", [hook]))
        if warmup and self.steps is not None and warmup >= self.steps:  # (epochs: the data decides later)
            raise ValueError(
                f"hook {self.hook!r}: its warmup={warmup} is the whole run ({self.steps} steps): it would never "
                "compress; lower warmup, or give the uncompressed hook (allreduce) by its name"
            )
        if self.sync != NO_SYNC:
            self._check_sync(hook)
        if self.compresses_momentum:
            self._check_compressed_momentum(hook)
        if self.parallel == "hsdp":
            self._check_nodes()
        if not self.network.strip():
            raise ValueError("network must be a profile such as loopback or 1gbit")

    @functools.cached_property
    def effective(self) -> TrainConfig:
        """This config as the run uses and records it (run.json, checkpoints, TensorBoard's HParams, a
        sweep's run names): :attr:`hook` and :attr:`sync` in their canonical texts, with the run's
        momentum (a hook with ``momentum=true``) and clipping (a hook with error feedback) moved into the
        hook, and the optimizer then without momentum (sgd, 0). Derived from what was said, which stays
        as it was; the effective config of an effective config is the same."""
        moved: dict[str, Any] = {"optimizer": "sgd", "momentum": 0.0} if self._takes_run_momentum else {}
        moved.setdefault("optimizer", parse_optimizer(self.optimizer))
        sync = NO_SYNC if self.sync_spec is None else str(self.sync_spec)
        return dataclasses.replace(self, hook=str(self._hook), sync=sync, **moved)

    @property
    def compresses_momentum(self) -> bool:
        """Whether the optimizer sends its momentum compressed (``compressed-adamw``), the hook then
        averaging the gradient only until the freeze."""
        return is_compressed_adamw_spec(self.optimizer)

    def _check_compressed_momentum(self, hook: hooks.AnySpec | hooks.AnyShardedSpec) -> None:
        """compressed-adamw attaches its own DDP hook, which averages through ``hook`` until the freeze."""
        where = "compressed-adamw sends the momentum itself, after DDP's backward"
        if self.parallel != "ddp" or self.sync != NO_SYNC:
            raise ValueError(f"{where}: it needs parallel ddp and sync none (FSDP2 shards the momentum; "
                             "local SGD and DiLoCo average parameters)")  # fmt: skip
        if not isinstance(hook, hooks.HookSpec) or hook.noop:
            raise ValueError(f"{where}: the hook, a gradcomp spec, averages the gradient until the freeze; got {hook}")
        if hook.compressor is not None and hook.compressor.ef:
            raise ValueError(f"{where}: the hook's error feedback would strand its residual at the freeze; "
                             f"use allreduce, a cast or an unbiased quantizer, not {hook}")  # fmt: skip

    @property
    def hook_spec(self) -> hooks.AnySpec | hooks.AnyShardedSpec:
        """The hook the run registers (:attr:`effective`'s), its generators seeded by :attr:`seed` unless
        the spec sets a seed (torch's PowerSGD is seeded by :attr:`seed` when registered)."""
        return self._derive_hook(seed=self.seed)

    @functools.cached_property
    def _hook(self) -> hooks.AnySpec | hooks.AnyShardedSpec:
        """The hook the run registers, unseeded: its ``str()`` is the effective :attr:`hook`."""
        return self._derive_hook(seed=None)

    @functools.cached_property
    def _said_hook(self) -> tuple[str, dict[str, str]] | None:
        """The hook's name and options as written; None for torch's and auto hooks (nothing moves into them)."""
        if hooks.is_torch_spec(self.hook) or hooks.is_auto_spec(self.hook):
            return None
        return split_spec(self.hook)

    @property
    def _takes_run_momentum(self) -> bool:
        """Whether the hook asks for the run's momentum (``momentum=true``: DGC's momentum correction)."""
        return self._said_hook is not None and self._said_hook[1].get("momentum", "").lower() == RUN_MOMENTUM

    def _derive_hook(self, seed: int | None) -> hooks.AnySpec | hooks.AnyShardedSpec:
        """:attr:`hook` parsed once (``seed`` applies where the spec sets none), then, through
        ``dataclasses.replace``, the run's momentum handed to a hook that asks for it and its clipping
        to a hook with error feedback, where DGC applies them: before compression, on each rank."""
        kind = self.parallel if self.sync == NO_SYNC else "ddp"  # outer gradients travel as DDP's do
        parse = {"fsdp": hooks.parse_sharded, "hsdp": hooks.parse_hybrid}.get(kind, hooks.parse)
        if self._said_hook is None:  # torch's or auto
            return parse(self.hook, seed)
        name, options = self._said_hook
        values: dict[str, Any] = dict(options)
        if self._takes_run_momentum:
            values["momentum"] = self._momentum_for_hook()  # what momentum=true stands for
        parser = hooks.ShardSpec if kind == "fsdp" else hooks.HookSpec
        spec = parser.parse((name, values), **({} if seed is None else {"seed": seed}))
        if isinstance(spec, hooks.HookSpec) and kind == "hsdp":
            hooks.parse_hybrid(spec)  # a flat shard's spec: PowerSGD and the like are refused
        feedback = NO_FEEDBACK if spec.compressor is None else spec.compressor.feedback
        if feedback.momentum and not self._takes_run_momentum and (self.momentum or self.optimizer == "nesterov"):
            raise ValueError(
                "momentum twice: the hook's correction and the optimizer's; "
                "write momentum=true in the hook to move the run's momentum there"
            )
        moved: dict[str, Any] = {"nesterov": True} if self._takes_run_momentum and self.optimizer == "nesterov" else {}
        if self.clip and feedback.variant is not None and self.sync == NO_SYNC:
            if "clip" in options and feedback.clip != self.clip:  # said, even if 0 (off)
                raise ValueError(f"clip twice: the run's {self.clip} and the hook's {feedback.clip}")
            moved["clip"] = self.clip
        return _with_feedback(spec, **moved) if moved else spec

    def _momentum_for_hook(self) -> float:
        """The run's momentum, for a hook that asks for it (``momentum=true``); the optimizer then runs
        without (:attr:`effective`)."""
        if self.parallel != "ddp" or self.sync != NO_SYNC:
            raise ValueError("momentum=true moves SGD's momentum into a DDP hook; not with fsdp or sync")
        if self.optimizer not in ("sgd", "nesterov"):
            raise ValueError(f"momentum=true moves SGD's momentum into the hook; the optimizer is {self.optimizer}")
        momentum = self.momentum or (0.9 if self.optimizer == "nesterov" else 0.0)
        if not momentum:
            raise ValueError("momentum=true takes the run's momentum, which is 0: set momentum")
        return momentum

    @property
    def clips_averaged(self) -> bool:
        """Whether the run clips the averaged gradients (a hook with error feedback clips before)."""
        if not self.clip:
            return False
        if self.sync != NO_SYNC:
            return True  # each replica's own gradients: the outer ones are not clipped
        compressor = getattr(self._hook, "compressor", None)  # torch's and auto hooks have none
        return not (compressor is not None and compressor.ef)

    @functools.cached_property
    def sync_spec(self) -> SyncSpec | None:
        """The sync spec, or None when the hook averages every step."""
        if self.sync == NO_SYNC:
            return None
        try:
            return SyncSpec.parse(self.sync)
        except ValueError as error:
            raise ValueError(f"sync {self.sync!r}: {error}; or none (the hook averages every step)") from None

    def _check_sync(self, hook: hooks.AnySpec | hooks.AnyShardedSpec) -> None:
        sync = self.sync_spec
        assert sync is not None
        if self.parallel == "hsdp" or (self.parallel == "fsdp" and sync.local_size <= 1):
            raise ValueError(
                f"sync {sync} trains a replica per rank (parallel ddp), or per node of local_size ranks, "
                f"DDP or FSDP2 inside (parallel ddp or fsdp, with local_size=L); not parallel {self.parallel}"
            )
        if not isinstance(hook, hooks.HookSpec) or hook.noop:
            raise ValueError(
                f"with sync {sync}, the hook is the gradcomp spec the outer gradients travel by (allreduce, "
                f"quantize:bits=4,ef=true, ...); {hook} averages every step"
            )
        if sync.local_size > 1:
            try:
                check_local_size(self.ranks, sync.local_size)
            except ValueError as error:
                raise ValueError(f"sync {sync}: {error}") from None

    @property
    def local_size(self) -> int | None:
        """The ranks per node the run is launched with (:func:`~gradcomp.experiments.training.parallel.node_size`)."""
        return node_size(self.network)

    def _check_nodes(self) -> None:
        """HSDP needs nodes: a node size that splits the ranks (torchrun's, under it) into two nodes or more."""
        check_nodes(self.network, int(os.environ.get("WORLD_SIZE", self.ranks)), "parallel hsdp")

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint or os.path.join(self.out, "checkpoint.pt")

    def total_steps(self, steps_per_epoch: int) -> int:
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None
        return max(1, math.ceil(self.epochs * steps_per_epoch))

    def to_dict(self) -> dict[str, Any]:
        """The :attr:`effective` settings as plain values: what run.json and checkpoints record."""
        return dataclasses.asdict(self.effective)


NO_SYNC = "none"
"""The ``sync`` of a run whose hook averages every step."""

RUN_MOMENTUM = "true"
"""The hook's ``momentum`` that stands for the run's (``topk:ratio=0.01,ef=true,momentum=true``)."""


def _with_feedback(spec: hooks.HookSpec | hooks.ShardSpec, **changes: Any) -> hooks.HookSpec | hooks.ShardSpec:
    """``spec`` with its error feedback's options changed (the run's momentum or clipping moved in)."""
    if isinstance(spec, hooks.ShardSpec):
        return dataclasses.replace(spec, hook=_hook_with_feedback(spec.hook, **changes))
    return _hook_with_feedback(spec, **changes)


def _hook_with_feedback(spec: hooks.HookSpec, **changes: Any) -> hooks.HookSpec:
    assert spec.compressor is not None  # only a compressor has error feedback
    feedback = dataclasses.replace(spec.compressor.feedback, **changes)
    return dataclasses.replace(spec, compressor=dataclasses.replace(spec.compressor, feedback=feedback))


def method(config: Mapping[str, Any]) -> str:
    """What a run compares by, from its config's values: the hook spec; with infrequent
    synchronization, the sync spec and the hook spec its outer gradients travel by
    (``diloco:every=50 over quantize:bits=4,ef=true``); with an optimizer that sends its momentum
    compressed, that optimizer and the hook of its warm-up (``compressed-adamw:freeze=30 after allreduce``)."""
    hook, sync = str(config.get("hook")), config.get("sync") or NO_SYNC
    optimizer = str(config.get("optimizer", ""))
    if is_compressed_adamw_spec(optimizer):
        return f"{optimizer}{OPTIMIZER_JOIN}{hook}"
    return hook if sync == NO_SYNC else f"{sync}{SYNC_JOIN}{hook}"


def split_method(text: str, join: str | None = None) -> tuple[str | None, str]:
    """A method's name (:func:`method`) as its sync spec (None for a hook alone) and its hook spec;
    with ``join`` :data:`OPTIMIZER_JOIN`, as its compressing optimizer and the hook of its warm-up."""
    first, joined, hook = text.partition(join or SYNC_JOIN)
    return (first.strip(), hook.strip()) if joined else (None, text)


SYNC_JOIN = " over "
"""Between the sync spec and the hook spec in a method's name (:func:`method`)."""
OPTIMIZER_JOIN = " after "
"""Between a compressing optimizer and the hook of its warm-up in a method's name (:func:`method`)."""


PATH_FIELDS = ("out", "checkpoint", "resume", "overwrite", "stop_at", "timeout")
"""Fields that say where a run writes and how it is driven, not what it computes."""

RESUMABLE_CHANGES = (*PATH_FIELDS, "steps", "epochs", "eval_every", "log_every", "checkpoint_every", "group_timeout")
"""Fields a resumed run may change; any other difference from the checkpoint is refused."""


def _positive(config: TrainConfig, *names: str, strict: bool = True) -> None:
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        if value < 0 or (strict and value == 0):
            raise ValueError(f"{name} must be {'> 0' if strict else '>= 0'}, got {value}")


def _choice(name: str, value: str, valid: Sequence[str] | Mapping[str, Any]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def check_batch(config: TrainConfig, task: Any | None = None) -> None:
    """Refuse a batch its task's data cannot serve (``--batch-size 100000`` on 1400 samples): a
    ``ValueError`` here, before a launcher claims the run's directory or starts a rank, rather than the
    same error in every rank. ``task``: the config's task, where the caller has built it already (a
    sweep builds each distinct task once)."""
    task = build_task(config.task, config.data) if task is None else task
    task.batch(0, config.batch_size, config.seed)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def from_mapping(values: Mapping[str, Any], where: str = "config") -> TrainConfig:
    """A config from plain values (TOML, run.json): unknown keys and wrong types are clear errors."""
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}; valid: {', '.join(field_names())}")
    hints = typing.get_type_hints(TrainConfig)
    try:
        return TrainConfig(**{key: convert(key, value, hints[key]) for key, value in values.items()})
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


# -- the command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per field: ``--batch-size`` for ``batch_size``, with its default and help. Values stay
    text here; :func:`from_args` converts them by the field's type, as sweep configs are."""
    docs = _field_docs()
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        default = COMMAND_LINE_STEPS if field.name == "steps" else field.default
        text = docs.get(field.name, "").replace("``", "")  # plain text on a terminal
        flag = {"nargs": "?", "const": "true"} if hints[field.name] is bool else {}  # --overwrite alone: true
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            default=None,
            metavar=field.name.upper(),
            help=text if default is None else f"{text} (default: {format_value(default)})",
            **flag,  # type: ignore[arg-type]
        )


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config the command line gives (200 steps unless it says how long)."""
    hints = typing.get_type_hints(TrainConfig)
    values = {}
    for name in field_names():
        text = getattr(args, name)
        if text is not None:
            try:
                values[name] = convert(name, text, hints[name])
            except ValueError as error:
                raise ValueError(f"--{name.replace('_', '-')}: {error}") from None
    if "steps" not in values and "epochs" not in values:
        values["steps"] = COMMAND_LINE_STEPS
    return TrainConfig(**values)


COMMAND_LINE_STEPS = 200
"""How long a run started from the command line trains when it says neither steps nor epochs."""


def _field_docs() -> dict[str, str]:
    """The attribute docstrings of :class:`TrainConfig` (the strings under each field)."""
    import ast
    import inspect
    import itertools
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, following in itertools.pairwise(body):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs
