"""What one measurement of ``gradcomp bench ddp`` (or ``fsdp``) is: :class:`BenchSettings`, checked
when it is built, so that a bad value or spec fails before any rank starts. The ranks get it whole."""

from __future__ import annotations

import dataclasses

from gradcomp.experiments.bench.modes import DDP, NOOP, Mode
from gradcomp.experiments.bench.workloads import PRESETS, BenchModel, UserModel
from gradcomp.options import parse_naming


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """One network's measurement: what trains on how many ranks, which variants, how long, how often.

    The variants are the anchors (``noop`` and ``mode.anchor``: torch's all-reduce for DDP), then
    ``torch_hooks``, then ``specs``, each once (:attr:`variants`)."""

    model: str | UserModel
    """A preset's name (:data:`~gradcomp.experiments.bench.workloads.PRESETS`: mlp, cnn, transformer),
    or a user's model (:func:`~gradcomp.experiments.bench.workloads.user_model`)."""
    ranks: int
    """Processes started on this machine (>= 2: a data-parallel benchmark needs peers)."""
    network: str
    """What they talk over: ``loopback`` or an emulated network's profile (``1gbit``; ``docs/networks.md``)."""
    specs: tuple[str, ...]
    """gradcomp's specs (DDP hooks, or sharded specs for FSDP2), or more of torch's (``torch:bf16``)."""
    torch_hooks: tuple[str, ...] | None = None
    """torch's own measured beside the anchors (``torch:`` specs); None: the mode's defaults."""
    steps: int = 30
    """Timed steps per variant (>= ``rounds``), ``steps // rounds`` in each round."""
    warmup: int = 5
    """Untimed steps per variant first (>= 2: DDP's bucket rebuild, PowerSGD's start, caches)."""
    rounds: int = 5
    """Rounds the timed steps are spread over, in an order of the variants rotated from round to round
    (so that the machine's drift hits every variant alike)."""
    seed: int = 0
    """The models' initial weights (the same for every variant) and the ranks' samples."""
    threads: int = 1
    """torch threads per rank."""
    timeout: float = 1800.0
    """Seconds one run's ranks may take in all before they are killed (an error)."""
    runs: int = 1
    """Independent runs on fresh ranks (>= 1); each figure is the median over them."""
    mode: Mode = DDP
    """DDP's replicas (``gradcomp bench ddp``) or FSDP2's shards (``gradcomp bench fsdp``)."""
    device: str = "cpu"
    """Where each rank computes: ``cpu``, or ``cuda`` (rank r on GPU r modulo the GPUs there are)."""
    backend: str = "gloo"
    """The process group's backend: ``gloo`` (any device) or ``nccl`` (``cuda``, a GPU per rank)."""
    accelerator_paths: bool = False
    """On the CPU, take the paths an accelerator's tensors take (``gradcomp.host.as_accelerator``:
    decided on the device, with no host read), to see their cost and their reads here."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, UserModel) and self.model not in PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; valid: {', '.join(PRESETS)}")
        if self.ranks < 2:
            raise ValueError(f"--ranks must be >= 2 (a data-parallel benchmark needs peers), got {self.ranks}")
        if self.steps < self.rounds or self.rounds < 1 or self.warmup < 2:
            raise ValueError(
                f"need rounds >= 1, steps >= rounds and warmup >= 2; got {self.rounds}, {self.steps}, {self.warmup}"
            )
        if self.runs < 1:
            raise ValueError(f"--runs must be >= 1, got {self.runs}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"--backend must be gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("--backend nccl needs --device cuda (NCCL moves GPU memory)")
        self.mode.check(self.network, self.ranks)
        for variant in self.variants:  # parses every spec: a bad one fails here, before any rank starts
            local = self.mode.local_size(variant)
            if local > 1 and self.ranks % local:
                raise ValueError(f"{variant}: local_size={local} does not divide the {self.ranks} ranks into nodes")

    @property
    def workload(self) -> BenchModel:
        """What the ranks train: the preset :attr:`model` names, or the user's model."""
        return self.model if isinstance(self.model, UserModel) else PRESETS[self.model]

    @property
    def variants(self) -> list[str]:
        """Every variant, in the tables' order: ``noop``, the anchor and torch's (in their canonical
        text), then each of :attr:`specs` as given (stripped) unless it repeats one before it."""
        torch_hooks = self.mode.torch_hooks if self.torch_hooks is None else self.torch_hooks
        torch_canonical = [parse_naming(h, self.mode.torch_canonical) for h in torch_hooks]
        baselines = list(dict.fromkeys([NOOP, self.mode.anchor, *torch_canonical]))
        seen, given = set(baselines), []
        for spec in self.specs:
            canonical = parse_naming(spec, self.mode.canonical)
            if canonical not in seen:
                seen.add(canonical)
                given.append(spec.strip())
        return [*baselines, *given]
