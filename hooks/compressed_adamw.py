"""CompressedAdamW: AdamW for DDP whose *momentum*, not its gradient, travels compressed, through any
gradcomp compressor (1-bit Adam's method: Tang et al., "1-bit Adam", ICML 2021).

Why not compress AdamW's gradient with error feedback: error feedback assumes the optimizer is linear
in the gradient, and Adam divides by the root of its second moment, which a compressed gradient's
error inflates; on the char LM, ``sign:ef=true`` under AdamW ends 29% worse in perplexity
(``docs/compressors.md``, "Under AdamW"). 1-bit Adam's way out, in two phases:

1. **Warm-up** (the first ``freeze`` steps): AdamW itself, on the gradient DDP averages through the
   warm-up hook (``allreduce``, or any gradcomp spec without error feedback: ``fp16``,
   ``quantize:bits=4``), while Adam's second moment ``v`` settles.
2. **Compressed** (from then on): ``v`` is frozen (with its bias correction at the freeze), so the
   update is linear in the momentum. DDP's hook sends nothing and hands each rank its own gradient;
   each rank folds it into the momentum, ``m_i = b1 m + (1 - b1) g_i``, and gradcomp's engine averages
   the ``m_i`` through the ``carrier`` spec (``sign:ef=true`` by default: a bit per coordinate, error
   feedback per tensor on each rank), so ``m`` is the same on every rank, bitwise. The update is
   AdamW's, ``p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^freeze)) + eps)`` after the decoupled
   weight decay ``p *= 1 - lr wd``, with each coordinate's step bounded by ``lr * bound``: a
   coordinate without gradient before the freeze has a frozen variance of 0.
3. Or, with ``variance_every=N``, the variance keeps learning after the freeze: each rank from its
   own gradients, the ranks' averaged every N steps (through ``variance_carrier``, bf16 by default)
   into the one every rank divides by, with that step's bias correction. A short warm-up then
   suffices, for 1 / N of a gradient's bytes a step.

Two safeguards, for a method that must hold on models and run lengths it was not tuned on:

- ``freeze="auto"`` freezes when the variance has settled rather than at a fixed step: every 10
  steps of the warm-up it compares AdamW's denominator ``sqrt(v / (1 - b2^t))`` with its value 10
  steps before, and freezes once it moved less than ``settle`` (10%, relative in L1). Every rank
  holds the same variance in the warm-up, so every rank decides alike, without a message; it reads
  one number on the host every 10 warm-up steps (a GPU synchronization there, none after).
- ``scaled=True`` compresses in Adam's units: an exchange is divided by AdamW's denominator (as of
  the last step, floored at a tenth of its tensor's root mean square) before its compressor and
  multiplied back after the average. A quantizer's chunk then spans coordinates of one scale (what
  each contributes to its update), and a layer norm's or a bias's small gradient no longer rounds
  in the range of the large ones beside it. The division is the same on every rank, so the average
  stays the average, an unbiased compressor stays unbiased, and error feedback after the freeze
  (where the denominator is frozen) keeps its residual in constant units.

>>> model = DistributedDataParallel(net)
>>> optimizer = CompressedAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, freeze=100)
>>> state = optimizer.attach(model)     # the DDP hook of both phases; the state for checkpoints

Costs per rank: AdamW's two moments, a flat copy of the momentum (the engine's buffer), and the
carrier's state (error feedback: a residual and a scratch buffer the size of the parameters). The
momentum's exchange runs in ``step()``, after backward, where 1-bit Adam runs it too: it cannot
overlap backward, which is why it must be small. Every parameter takes part in every exchange (one
without a gradient counts a zero gradient), so every rank must hold the same parameters.
"""

# No ``from __future__ import annotations`` here: DDP checks its hook's annotations at run time.
import collections
import datetime
import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp.engine import Engine, HookSpec, HookSpecLike
from gradcomp.engine.stats import StepStats, newest, steps_since, write_trace
from gradcomp.flat import views
from gradcomp.hooks import ddp
from gradcomp.hooks.compressed_adamw_spec import AUTO, DEFAULT_CARRIER, SETTLE_EVERY, CompressedAdamWSpec
from gradcomp.state import TrainingHookState

SCALE_FLOOR = 0.1
"""A scaled exchange's smallest divisor, as a fraction of its tensor's root-mean-square denominator."""
logger = logging.getLogger(__name__)
HISTORY = 10_000
"""Steps of statistics kept (the latest), as a hook's engine keeps its buckets."""


class CompressedAdamW(torch.optim.Optimizer):
    """AdamW whose momentum travels compressed after ``freeze`` uncompressed steps (module notes).

    Args:
        params: the DDP model's parameters (or parameter groups, each with its ``lr`` and
            ``weight_decay``), of one dtype and device.
        lr, betas, eps, weight_decay: AdamW's (``torch.optim.AdamW``; decoupled weight decay).
        freeze: uncompressed steps, after which Adam's variance is frozen and the momentum travels
            through ``carrier``: long enough for the variance to settle, which a learning-rate
            warm-up's end is not (on the char LM of 300 steps, freezing at step 30 cost 6% in
            perplexity by itself, at step 100 nothing: ``docs/compressors.md``), and every step of
            it costs the whole gradient. ``"auto"``: freeze once the variance has settled, measured:
            the first check (every :data:`SETTLE_EVERY` steps) at which AdamW's denominator moved
            less than ``settle`` since the last one (about step 50-60 of the char LM with ``settle``
            0.1, whatever the run's length).
        carrier: the hook spec the momentum travels by (``sign:ef=true``, ``topk:ratio=0.01,ef=true``,
            ``quantize:bits=2,ef=true``, ...); biased compressors want error feedback.
        bound: after the freeze, the largest step of a coordinate, in units of ``lr`` (Adam's
            normalized update rarely passes 1; a coordinate whose frozen variance is 0 would).
        variance_every: 0 to keep the variance frozen after the freeze (1-bit Adam); N to let each
            rank go on learning it from its own gradients and average the ranks' every N steps
            through ``variance_carrier`` (``bf16`` by default): the variance every rank divides by
            then keeps up with training, for 1 / N of a gradient's bytes per step (bf16: half).
        scaled: compress each exchange in Adam's units: the warm-up's gradient and the momentum are
            divided by AdamW's denominator before their compressor and multiplied back after the
            average (module notes). Costs a pass over the gradient each way, and a buffer per bucket.
        settle: ``freeze="auto"``'s threshold, a relative change (L1) of AdamW's denominator over
            :data:`SETTLE_EVERY` steps. Lower freezes later: a variance averaged over more steps,
            for more bytes. On issue 49's grid 0.07 froze at step 70-80 instead of 50-60 and held
            every cell within 2% (the documented 10x recipe, ``docs/hooks.md``), where 0.1 missed one.

    Until :meth:`attach` the optimizer is AdamW on whatever gradient it finds (one process, or a
    model whose gradients something else averages), and a compressed step among several ranks is
    refused: it would average nothing.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        freeze: int | str = 100,
        carrier: HookSpecLike = DEFAULT_CARRIER,
        bound: float = 1.0,
        variance_every: int = 0,
        variance_carrier: HookSpecLike = "bf16",
        scaled: bool = False,
        settle: float = 0.1,
    ) -> None:
        if not (math.isfinite(lr) and lr >= 0) or not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"lr and weight_decay must be finite and >= 0, got {lr} and {weight_decay}")
        self.spec = CompressedAdamWSpec(freeze, str(HookSpec.parse(carrier)), betas[0], betas[1], eps, bound,
                                        variance_every, str(HookSpec.parse(variance_carrier)), scaled,
                                        settle)  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        parameters = self._parameters()
        if len({(p.dtype, p.device) for p in parameters}) > 1:
            raise ValueError("CompressedAdamW averages one flat momentum: give it parameters of one dtype and device")
        self.hook_state: CompressedAdamWState | None = None
        self._flat: Tensor | None = None  # the momenta, back to back: what the carrier averages
        self._denominators: dict[nn.Parameter, Tensor] | None = None  # frozen with the variance
        self._scales: dict[object, Tensor] = {}  # what a scaled exchange divides by: per bucket, and the momentum's
        self.frozen_at: int | None = None if self.spec.freeze == AUTO else int(self.spec.freeze)
        """The step after which the momentum travels compressed: ``freeze``, or with ``freeze=auto``
        the step at which the variance was found settled (None until then)."""
        self._settle_before: Tensor | None = None  # freeze=auto: the denominator SETTLE_EVERY steps ago
        self.local_variance: Tensor | None = None
        """This rank's own variance, flat, learned after the freeze (``variance_every``): per rank,
        saved with the hook's state."""

    @classmethod
    def from_spec(
        cls, params: Iterable[nn.Parameter], spec: CompressedAdamWSpec, lr: float, weight_decay: float
    ) -> "CompressedAdamW":
        """The optimizer a ``compressed-adamw`` spec describes (a training run's ``--optimizer``)."""
        return cls(params, lr, (spec.beta1, spec.beta2), spec.eps, weight_decay, freeze=spec.freeze,
                   carrier=spec.carrier, bound=spec.bound, variance_every=spec.variance_every,
                   variance_carrier=spec.variance_carrier, scaled=spec.scaled, settle=spec.settle)  # fmt: skip

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken, resumed ones included (saved with the optimizer's state)."""
        first = self._parameters()[0]
        return int(self.state[first].get("step", 0)) if first in self.state else 0

    @property
    def compressing(self) -> bool:
        """Whether the next step sends the momentum through the carrier (the freeze is past)."""
        return self.frozen_at is not None and self.steps_done >= self.frozen_at

    def attach(
        self,
        model: DistributedDataParallel,
        warmup: HookSpecLike = "allreduce",
        *,
        timeout: datetime.timedelta | None = None,
    ) -> "CompressedAdamWState":
        """Register the DDP hook of both phases on ``model`` and build the momentum's exchange (on the
        group DDP communicates on); returns the state, for statistics and checkpoints.

        ``warmup``: the hook spec that averages gradients until the freeze (``allreduce``, ``fp16``,
        ``quantize:bits=4``, ...): not ``noop`` (the ranks would drift apart), and without error
        feedback, whose residual would be stranded when the hook falls silent at the freeze. After the
        freeze the hook hands DDP each rank's own gradient: averaging it too would send the gradient's
        bytes besides the momentum's."""
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"attach takes the DistributedDataParallel model whose gradients it averages, got "
                f"{type(model).__name__}: wrap it first (DistributedDataParallel(model))"
            )
        if self.hook_state is not None:
            raise RuntimeError("this optimizer is attached already: one model, one hook")
        spec = HookSpec.parse(warmup)
        if spec.noop:
            raise ValueError(
                "the warm-up hook averages gradients until the freeze: noop would let the ranks drift apart"
            )
        assert spec.compressor is not None
        if spec.compressor.ef:
            raise ValueError(
                f"warm-up hook {spec}: its error feedback's residual would be stranded when the hook stops "
                "at the freeze; use allreduce, a cast (fp16, bf16) or an unbiased quantizer (quantize:bits=4)"
            )
        group = model.process_group
        warm_state, _ = ddp.make(spec, group=group, timeout=timeout)
        carrier = Engine(self.spec.carrier, group=group, timeout=timeout)
        variance = (
            Engine(self.spec.variance_carrier, group=group, timeout=timeout) if self.spec.variance_every else None
        )
        self.hook_state = CompressedAdamWState(self, warm_state, carrier, variance, dist.get_world_size(group))
        model.register_comm_hook(self.hook_state, _hook)
        return self.hook_state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step: on the averaged gradient until the freeze, then on the momentum averaged
        through the carrier (which waits for the exchange)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.compressing
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)
        step = self.steps_done + 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            parameters = group["params"]
            for p in parameters:
                self.state[p]["step"] = step
            if not compressing:
                with_grad = [p for p in parameters if p.grad is not None]
                grads = [p.grad for p in with_grad]
                torch._foreach_lerp_(self._moments(with_grad, "exp_avg"), grads, 1 - beta1)
                squares = self._moments(with_grad, "exp_avg_sq")
                torch._foreach_mul_(squares, beta2)
                torch._foreach_addcmul_(squares, grads, grads, 1 - beta2)
        if not compressing and self.frozen_at is None and step % SETTLE_EVERY == 0:
            self._check_settled(step)
        if compressing:
            self._average_momentum()
            if self.spec.variance_every:
                self._learn_variance(step)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            if compressing:
                self._frozen_update(group, 1 - beta1**step)
            else:
                moved = [p for p in group["params"] if p.grad is not None]
                self._adamw_update(moved, group, 1 - beta1**step, 1 - beta2**step)
        if self.hook_state is not None:
            self.hook_state.close_step()
        return loss

    def _init_state(self, p: nn.Parameter) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _moments(self, parameters: Sequence[Tensor], name: str) -> list[Tensor]:
        return [self.state[p][name] for p in parameters]

    def _average_momentum(self) -> None:
        """Each rank's momentum with its own gradient folded in, averaged through the carrier: the
        same ``m`` on every rank."""
        parameters = self._parameters()
        flat = self._flat_momentum(parameters)
        for group in self.param_groups:
            beta1, _ = group["betas"]
            for p in group["params"]:
                m = self.state[p]["exp_avg"]
                if p.grad is None:
                    m.mul_(beta1)  # a zero gradient
                else:
                    m.lerp_(p.grad, 1 - beta1)
        if self.hook_state is not None:
            carrier = self.hook_state.carrier
            scale = None
            if self.spec.scaled:  # the denominator is frozen: the same scale every step, until the variance moves
                scale = self._scales.get("momentum")
                if scale is None:
                    scale = self._scales["momentum"] = self.exchange_scale(parameters, self.variance_step())
                flat.div_(scale)
            carrier.reduce(flat, list(range(len(parameters))), [p.shape for p in parameters], last=True).wait()
            carrier.end_step()
            if scale is not None:
                flat.mul_(scale)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "a compressed step averages the momentum through the hook's state: call attach(model) first"
            )

    def _learn_variance(self, step: int) -> None:
        """This rank's variance with its own gradient folded in; every ``variance_every`` steps after
        the freeze, the ranks' averaged into the variance every rank divides by (linear, so averaging
        in place, and going on from the average, is what averaging the ranks' own would give)."""
        parameters = self._parameters()
        if self.local_variance is None:  # from the variance every rank froze with
            self.local_variance = torch.cat([self.state[p]["exp_avg_sq"].reshape(-1) for p in parameters])
        local = views(self.local_variance, [p.shape for p in parameters])
        held = iter(local)  # in the order of _parameters(): group by group
        for group in self.param_groups:
            _, beta2 = group["betas"]
            for p, mine in zip(group["params"], held, strict=False):  # held runs on over the groups
                mine.mul_(beta2)
                if p.grad is not None:
                    mine.addcmul_(p.grad, p.grad, value=1 - beta2)
        assert self.frozen_at is not None  # learning the variance comes after the freeze
        if (step - self.frozen_at) % self.spec.variance_every:
            return
        if self.hook_state is not None and self.hook_state.variance is not None:
            variance = self.hook_state.variance
            shapes = [p.shape for p in parameters]
            variance.reduce(self.local_variance, list(range(len(parameters))), shapes, last=True).wait()
            variance.end_step()
            self.local_variance.clamp_(min=0)  # a lossy carrier may round a tiny variance below 0
        for p, averaged in zip(parameters, local, strict=True):
            self.state[p]["exp_avg_sq"].copy_(averaged)
        self._denominators = None
        self._scales.pop("momentum", None)

    def _check_settled(self, step: int) -> None:
        """``freeze=auto``: freeze after this step if AdamW's denominator moved less than ``settle``
        (relative, in L1) since :data:`SETTLE_EVERY` steps ago. One number read on the host, every
        :data:`SETTLE_EVERY` steps of the warm-up; every rank holds the same variance (the warm-up
        averages the gradient), so every rank decides alike."""
        parameters = self._parameters()
        now = torch.cat([v.reshape(-1) for v in self._moments(parameters, "exp_avg_sq")])
        now.div_(1 - self.spec.beta2**step).sqrt_()
        before, self._settle_before = self._settle_before, now
        if before is None:
            return
        change = (now - before).abs_().sum() / now.sum().clamp_min(torch.finfo(now.dtype).tiny)
        if change.item() < self.spec.settle:
            self.frozen_at, self._settle_before = step, None
            logger.info("compressed-adamw: the variance settled (changed %.3g in %d steps): frozen at step %d",
                        change.item(), SETTLE_EVERY, step)  # fmt: skip

    def variance_step(self) -> int:
        """The step whose variance every rank divides by: the freeze's, or the last average's."""
        every, freeze, done = self.spec.variance_every, self.frozen_at, self.steps_done
        assert freeze is not None, "the variance is frozen only after the freeze"
        if not every or done < freeze + every:
            return freeze
        return freeze + (done - freeze) // every * every

    def _flat_momentum(self, parameters: list[nn.Parameter]) -> Tensor:
        """The momenta as views of one flat buffer (built once; again after a checkpoint's load)."""
        if self._flat is None:
            momenta = [self.state[p]["exp_avg"] for p in parameters]
            self._flat = torch.cat([m.reshape(-1) for m in momenta])
            for p, view in zip(parameters, views(self._flat, [p.shape for p in parameters]), strict=True):
                self.state[p]["exp_avg"] = view
        return self._flat

    def _adamw_update(
        self, parameters: list[Tensor], group: dict[str, Any], correction1: float, correction2: float
    ) -> None:
        """AdamW's update, in torch's order (``torch.optim.AdamW(foreach=False)``, bitwise)."""
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        if decay:
            torch._foreach_mul_(parameters, 1 - lr * decay)
        denominators = torch._foreach_sqrt(self._moments(parameters, "exp_avg_sq"))
        torch._foreach_div_(denominators, correction2**0.5)  # torch's rounding
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(parameters, self._moments(parameters, "exp_avg"), denominators, -lr / correction1)

    def _frozen_update(self, group: dict[str, Any], correction1: float) -> None:
        """The update with the variance frozen at the freeze: its denominators computed once, each
        coordinate's step bounded by ``lr * bound`` (a coordinate with no gradient before the freeze
        has a variance of 0: a momentum arriving later, or the carrier's error, would step by
        ``lr * m / eps``)."""
        parameters = group["params"]
        if self._denominators is None:
            self._denominators = {}
        missing = [p for p in parameters if p not in self._denominators]
        if missing:
            correction2 = 1 - group["betas"][1] ** self.variance_step()
            denominators = torch._foreach_sqrt(self._moments(missing, "exp_avg_sq"))
            torch._foreach_div_(denominators, correction2**0.5)
            torch._foreach_add_(denominators, group["eps"])
            self._denominators.update(zip(missing, denominators, strict=True))
        lr, decay, bound = group["lr"], group["weight_decay"], self.spec.bound
        if decay:
            torch._foreach_mul_(parameters, 1 - lr * decay)
        steps = torch._foreach_div(self._moments(parameters, "exp_avg"), [self._denominators[p] for p in parameters])
        torch._foreach_mul_(steps, 1 / correction1)
        torch._foreach_clamp_min_(steps, -bound)
        torch._foreach_clamp_max_(steps, bound)
        torch._foreach_add_(parameters, steps, alpha=-lr)

    def exchange_scale(self, parameters: Sequence[Tensor], step: int, key: object = None) -> Tensor:
        """What a scaled exchange of ``parameters`` divides by, flat: AdamW's denominators
        ``sqrt(v / (1 - b2^step))`` (ones before the first step), each floored at :data:`SCALE_FLOOR`
        of its tensor's root mean square (a coordinate whose variance is still 0, an embedding row
        not seen yet, would otherwise dominate its chunk's range). With a ``key`` the buffer is kept
        and refilled by the next call with that key (a bucket's, every step).

        Cost: a fixed number of operators whatever the number of tensors (a bucket of GPT-2's 148
        holds dozens): the variances copied in one ``_foreach_copy_``, their norms in one
        ``_foreach_norm``, each tensor's floor spread over its elements by one ``repeat_interleave``
        (the sizes on the device made once per layout: :func:`_sizes`); no host read."""
        total = sum(p.numel() for p in parameters)
        flat = self._scales.get(key) if key is not None else None
        if flat is None or flat.numel() != total:
            flat = torch.empty(total, dtype=parameters[0].dtype, device=parameters[0].device)
            if key is not None:
                self._scales[key] = flat
        if step == 0 or not total:
            return flat.fill_(1)
        present = [p for p in parameters if p.numel()]
        roots = views(flat, [p.shape for p in present])
        variances = [(self.state.get(p) or {}).get("exp_avg_sq") for p in present]
        known = [(root, v) for root, v in zip(roots, variances, strict=True) if v is not None]
        if known:
            torch._foreach_copy_([root for root, _ in known], [v for _, v in known])
        for root, variance in zip(roots, variances, strict=True):
            if variance is None:  # in DDP's buckets, not in this optimizer: floored as a tensor not seen yet
                root.zero_()
        flat.sqrt_().div_((1 - self.spec.beta2**step) ** 0.5)
        # A tensor's floor is a tenth of its root mean square; a tensor with no variance yet (no gradient
        # so far) takes the whole exchange's instead, not eps (its first gradient would swamp its chunk).
        # Chosen on the device: no host read.
        sizes, roots_of_sizes = _sizes(tuple(p.numel() for p in present), flat.dtype, flat.device)
        everyone = torch.linalg.vector_norm(flat) / flat.numel() ** 0.5
        own = torch.stack(torch._foreach_norm(roots)).div_(roots_of_sizes)
        floors = torch.where(own > 0, own, everyone).mul_(SCALE_FLOOR).add_(self.spec.eps)
        return torch.maximum(flat, floors.repeat_interleave(sizes, output_size=flat.numel()), out=flat)

    def _parameters(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state, and ``freeze=auto``'s: the step it froze at, or the denominator it compares with."""
        return {**super().state_dict(), "freeze": {"frozen_at": self.frozen_at, "settle_before": self._settle_before}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state (moments and step count, the same on every rank); the flat momentum is built
        again from it at the next compressed step."""
        freeze = state_dict.get("freeze")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "freeze"})
        self._flat = self._denominators = None
        self._scales.clear()
        if freeze is not None:
            self.frozen_at, self._settle_before = freeze["frozen_at"], freeze["settle_before"]


class CompressedAdamWState(TrainingHookState):
    """What :meth:`CompressedAdamW.attach` returns: the warm-up hook's state and the carrier's engine.
    Statistics per optimizer step (numbered by the optimizer's steps, which a resumed run continues):
    the warm-up hook's buckets until the freeze, the momentum's exchange after it. Checkpoints hold
    both (error feedback's residuals are per rank: save every rank's, as for a hook)."""

    def __init__(
        self, optimizer: "CompressedAdamW", warmup: ddp.HookState, carrier: Engine, variance: Engine | None, world: int
    ) -> None:
        self.optimizer, self.warmup, self.carrier, self.variance, self.world = (
            optimizer,
            warmup,
            carrier,
            variance,
            world,
        )
        self._steps: collections.deque[StepStats] = collections.deque(maxlen=HISTORY)
        self._read = {"warmup": 0, "carrier": 0, "variance": 0}  # each engine's next step to take in
        self._own_error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        return self._own_error or self.warmup.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self._own_error = value

    @property
    def spec(self) -> str:
        """The optimizer's spec and the warm-up hook's: what a checkpoint must be resumed with."""
        return f"{self.optimizer.spec} after {self.warmup.spec}"

    def close_step(self) -> None:
        """Sum what the step's exchanges cost into its :class:`StepStats` (called by ``step()``)."""
        total = StepStats.zero(self.optimizer.steps_done - 1)  # the step just taken (counted from 0)
        for name, records in self._records():
            for stats in steps_since(records, self._read[name]):
                total += stats
                self._read[name] = stats.step + 1
        self._steps.append(total)

    def _records(self) -> list[tuple[str, collections.deque[Any]]]:
        records = [("warmup", self._warmup_records()), ("carrier", self.carrier.records)]
        return records + ([("variance", self.variance.records)] if self.variance is not None else [])

    def _warmup_records(self) -> collections.deque[Any]:
        assert self.warmup.engine is not None  # noop is refused
        return self.warmup.engine.records

    def steps_since(self, first: int) -> list[StepStats]:
        return newest(self._steps, first)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """The warm-up hook's buckets and the momentum's exchanges, on one timeline."""
        records = sorted([r for _, held in self._records() for r in held], key=lambda r: r.queued)
        write_trace(records, path, dist.get_rank())

    def state_dict(self) -> dict[str, Any]:
        """The specs and world size, the warm-up hook's state and the carrier's (its compressor's:
        error feedback's residuals, per rank; its engine's), and this rank's own variance (None
        until it learns one)."""
        return {
            "spec": self.spec,
            "world_size": self.world,
            "warmup": self.warmup.state_dict(),
            "compressor": self.carrier.compressor.state_dict(),
            "engine": self.carrier.state_dict(),
            "variance": self.optimizer.local_variance,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ddp.check_saved(state, self.spec, self.world, "compressed-adamw")
        self.warmup.load_state_dict(state["warmup"])
        self.carrier.compressor.load_state_dict(state["compressor"])
        self.carrier.load_state_dict(state["engine"])
        variance = state.get("variance")
        self.optimizer.local_variance = None if variance is None else variance.clone()


@functools.lru_cache(maxsize=64)
def _sizes(sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """A layout's tensor sizes (int64) and their square roots (``dtype``) on ``device``, made once (a
    bucket's layout repeats every step): what :meth:`CompressedAdamW.exchange_scale` spreads and
    divides by, without a copy from the host in the step."""
    roots = [math.sqrt(n) for n in sizes]
    return torch.tensor(sizes, device=device), torch.tensor(roots, dtype=dtype, device=device)


def _hook(state: CompressedAdamWState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Until the freeze, the warm-up hook's average; then each rank's own gradient, untouched."""
    optimizer = state.optimizer
    if optimizer.compressing:
        return ddp.unchanged(bucket)
    if not optimizer.spec.scaled:
        return ddp.gradcomp_hook(state.warmup, bucket)
    scale = optimizer.exchange_scale(bucket.parameters(), optimizer.steps_done, key=bucket.index())
    bucket.buffer().div_(scale)
    return ddp.gradcomp_hook(state.warmup, bucket).then(lambda done: done.value().mul_(scale))
