"""The training loop of one rank: timed steps, periodic logging and evaluation, checkpoints on request.

Every rank runs the same loop and issues the same collectives at the same steps (the loss average
at log points, the evaluation sums, the checkpoint's gathers), so nothing can deadlock or interleave
differently on different ranks. Training time (``elapsed``) counts the steps only: evaluation,
logging and checkpoints are excluded, so curves against time compare the training itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradcomp.experiments.tasks import Task
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.metrics import WireMeter, Writer
from gradcomp.experiments.training.parallel import AnyPlacement

logger = logging.getLogger(__name__)

EVAL_BATCH = 512
"""Samples (windows, for language models) per evaluation forward pass."""

PARTS = ("data", "forward", "backward_comm", "optimizer", "sync")
"""A step's parts: ``sync`` is infrequent synchronization's (local SGD, DiLoCo), zero under DDP's hooks."""
COMPUTE_REPEATS = 5
"""Steps without communication timed at the end of a run (:meth:`Loop.compute_ms`)."""


class Loop:
    """Trains the model (DDP's replicas, FSDP2's shards, or replicas synchronized every few steps:
    ``placement``) from a step to ``min(total, config.stop_at)``; see :meth:`run`."""

    def __init__(
        self,
        config: TrainConfig,
        task: Task,
        placement: AnyPlacement,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        meter: WireMeter,
        writer: Writer,
        rank: int,
        world: int,
        device: torch.device,
        total: int,
        save: Callable[[int, float], None],
    ) -> None:
        self.config, self.task, self.placement = config, task, placement
        self.optimizer, self.schedule, self.meter, self.writer = optimizer, schedule, meter, writer
        self.rank, self.world, self.device, self.total, self.save = rank, world, device, total, save
        self.eval_every = config.eval_every or max(1, total // 10)
        self.end = min(total, config.stop_at) if config.stop_at else total
        self.step = 0
        self.elapsed = 0.0
        self._times = dict.fromkeys(PARTS, 0.0)  # this invocation's totals, for the final means
        self._window = dict.fromkeys(PARTS, 0.0)
        self._window_steps = 0
        self._steps_run = 0  # by this invocation
        self._window_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._clip = config.clip if config.clips_averaged else 0.0  # else the hook clipped, before compression
        self._parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.train_loss: float | None = None

    def run(self, start: int, elapsed: float) -> dict[str, Any]:
        """Train from step ``start`` (``elapsed`` training seconds so far); return the final metrics."""
        self.step, self.elapsed = start, elapsed
        first_step, first_elapsed = start, elapsed
        evaluated: dict[str, float] = {}
        evaluated_at = -1
        if start == 0 and self.task.evaluates:
            evaluated, evaluated_at = self.evaluate(), 0
        collect_every = min(self.config.log_every, 100)  # the hook keeps the latest 10,000 buckets only
        while self.step < self.end:
            self._train_step()
            logging = self.step % self.config.log_every == 0 or self.step == self.end
            if logging or self.step % collect_every == 0:  # a log point reports the bytes sent up to it
                self.meter.collect()
            if logging:
                self._log()
            if self.task.evaluates and (self.step % self.eval_every == 0 or self.step == self.end):
                evaluated, evaluated_at = self.evaluate(), self.step
            every = self.config.checkpoint_every
            if every and self.step % every == 0 and self.step < self.end:
                self.save(self.step, self.elapsed)
        if self.task.evaluates and evaluated_at != self.step:
            evaluated = self.evaluate()
        self.meter.collect()
        return self._final(evaluated, self.step - first_step, self.elapsed - first_elapsed)

    def _train_step(self) -> None:
        config, sync = self.config, self._synchronize
        began = time.perf_counter()
        x, y = self.task.batch(self.step, config.batch_size, config.seed)
        x = x[self.rank :: self.world].to(self.device, non_blocking=True)
        y = y[self.rank :: self.world].to(self.device, non_blocking=True)
        sync()
        loaded = time.perf_counter()
        loss = self.task.loss(self.placement.forward(x), y)
        sync()
        forwarded = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the hook averages (DDP) or reduce-scatters (FSDP2) meanwhile; done when it returns
        sync()
        backwarded = time.perf_counter()
        if self._clip:
            torch.nn.utils.clip_grad_norm_(self._parameters, self._clip)
        self.optimizer.step()
        self.schedule.step()
        sync()
        stepped = time.perf_counter()
        self.placement.after_step(last=self.step + 1 == self.total)  # local SGD and DiLoCo synchronize here
        sync()
        finished = time.perf_counter()
        parts = (loaded - began, forwarded - loaded, backwarded - forwarded, stepped - backwarded, finished - stepped)
        for part, seconds in zip(PARTS, parts, strict=True):
            self._times[part] += seconds
            self._window[part] += seconds
        self._window_loss += loss.detach().double()
        self._window_steps += 1
        self._steps_run += 1
        self.elapsed += finished - began
        self.step += 1

    def compute_ms(self, repeats: int = COMPUTE_REPEATS) -> float:
        """A training step's time without its communication, in ms: data, forward and backward under
        ``no_sync`` (the hook communicates nothing; FSDP2 still all-gathers parameters), the slowest
        rank's, median of ``repeats``, plus the run's mean optimizer time. Read once the run has
        finished (it changes no parameter, but its gradients are cleared): what a step would cost on
        an infinitely fast link, the compute part of a step-time breakdown."""
        times = torch.zeros(repeats, dtype=torch.float64)
        for i in range(-1, repeats):  # one untimed: caches
            began = time.perf_counter()
            x, y = self.task.batch(max(self.step - 1, 0), self.config.batch_size, self.config.seed)
            x = x[self.rank :: self.world].to(self.device, non_blocking=True)
            y = y[self.rank :: self.world].to(self.device, non_blocking=True)
            with self.placement.no_sync():
                self.task.loss(self.placement.forward(x), y).backward()
            self._synchronize()
            if i >= 0:
                times[i] = time.perf_counter() - began
            self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        optimizer_ms = 1e3 * self._times["optimizer"] / self._steps_run if self._steps_run else 0.0
        return 1e3 * float(times.median()) + optimizer_ms

    def _synchronize(self) -> None:
        if self.device.type == "cuda":  # the times of asynchronous kernels need it
            torch.cuda.synchronize(self.device)

    def _log(self) -> None:
        """Training scalars for the steps since the last call (the loss averaged over the ranks)."""
        n = self._window_steps
        if not n:
            return
        loss = self._window_loss / n
        dist.all_reduce(loss)
        self.train_loss = float(loss) / self.world
        step_seconds = sum(self._window.values()) / n
        scalars = {
            "train/loss": self.train_loss,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/steps_per_s": 1 / step_seconds if step_seconds else float("nan"),
            "time/step_ms": 1e3 * step_seconds,
            **{f"time/{part}_ms": 1e3 * seconds / n for part, seconds in self._window.items()},
            **self.meter.drain(),
        }
        self.writer.scalars(scalars, self.step, self.elapsed)
        for decision in self.meter.decisions():  # the auto hook's: what it chose and why
            self.writer.text("hook/decision", f"step {decision['step']}: {decision['reason']}", self.step, self.elapsed)
        self.writer.points("train", {"loss": self.train_loss}, self.step, self.elapsed, self.meter.total)
        logger.info(
            "step %d/%d: train loss %.4f, %.1f ms/step", self.step, self.end, self.train_loss, 1e3 * step_seconds
        )
        self._window = dict.fromkeys(PARTS, 0.0)
        self._window_loss.zero_()
        self._window_steps = 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the whole evaluation set (each rank a shard; sums all-reduced)."""
        self.meter.collect()
        x, y = self.task.eval_set()
        total = len(x)
        x, y = x[self.rank :: self.world], y[self.rank :: self.world]
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        with self.placement.evaluated() as model:  # DiLoCo's: the global parameters
            model.eval()
            for xb, yb in self.placement.eval_batches(x, y, EVAL_BATCH, total):
                sums += self.task.eval_sums(model(xb.to(self.device)), yb.to(self.device)).double()
            model.train()
        dist.all_reduce(sums)
        metrics = self.task.eval_metrics(sums.cpu())
        logger.info("step %d: %s", self.step, ", ".join(f"eval {k} {v:.4g}" for k, v in metrics.items()))
        self.writer.scalars({f"eval/{k}": v for k, v in metrics.items()}, self.step, self.elapsed)
        self.writer.points("eval", metrics, self.step, self.elapsed, self.meter.total)
        return metrics

    def _final(self, evaluated: dict[str, float], steps: int, seconds: float) -> dict[str, Any]:
        """The run's final metrics (rates and time means over this invocation's steps)."""
        rate = steps / seconds if seconds else None
        metrics: dict[str, Any] = {
            "step": self.step,
            "total_steps": self.total,
            "train_loss": self.train_loss,
            **{f"eval_{k}": v for k, v in evaluated.items()},
            "wire_bytes": self.meter.total,
            "wire_bytes_estimated": self.meter.estimated,
            "inter_node_bytes": self.meter.across if self.meter.steps else None,
            "compression_ratio": self.meter.compression_ratio,
            "train_time_s": self.elapsed,
            "steps_per_s": rate,
            "samples_per_s": rate * self.config.batch_size if rate else None,
        }
        frozen_at = getattr(self.optimizer, "frozen_at", None)  # CompressedAdamW: where its warm-up ended
        if frozen_at is not None:
            metrics["frozen_at"] = frozen_at
        for part, total in self._times.items():
            metrics[f"{part}_ms"] = 1e3 * total / steps if steps else None
        hooked = self.meter.steps
        for key, spent in self.meter.hook_seconds.items():  # on the hook's thread, overlapping backward
            metrics[f"{key}_ms"] = 1e3 * spent / hooked if spent is not None and hooked else None
        return metrics
