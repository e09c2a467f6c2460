"""Train a model with DDP and a gradcomp communication hook, logging what compression costs and buys.

    torchrun --nproc-per-node 2 experiments/train.py --task digits --hook topk:ratio=0.01,ef=true --out runs/topk

On several machines (the same command on each; HOST:PORT is the first machine's address):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id RUN \\
        experiments/train.py --backend nccl --task charlm --hook powersgd:rank=4,ef=true --steps 2000 --out runs/lm

Without torchrun, on this machine, starting the ranks itself (optionally behind an emulated network):

    python -m gradcomp.experiments.train --ranks 2 --network 1gbit --task digits --hook fp16 --steps 400

``gradcomp sweep CONFIG`` runs grids of these (:mod:`gradcomp.experiments.sweep`). Every option is a
field of :class:`~gradcomp.experiments.training.config.TrainConfig`; ``--help`` lists them. A run writes
to ``--out``: TensorBoard events (:mod:`~gradcomp.experiments.training.metrics` lists the tags),
``run.json`` and ``checkpoint.pt`` (``--resume auto`` continues from it, exactly). See
``docs/experiments.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradcomp import netem
from gradcomp.experiments.models import parameter_count
from gradcomp.experiments.tasks import build_task
from gradcomp.experiments.training import checkpoint, parallel, runinfo
from gradcomp.experiments.training.config import PATH_FIELDS, TrainConfig, add_arguments, check_batch, from_args
from gradcomp.experiments.training.loop import Loop
from gradcomp.experiments.training.metrics import NullWriter, TensorBoardWriter, WireMeter, Writer
from gradcomp.experiments.training.optim import make_optimizer, make_schedule
from gradcomp.launch import RankError, is_user_error, one_line, preload, spawn
from gradcomp.netem import NetemError
from gradcomp.state import TrainingHookState

logger = logging.getLogger(__name__)

preload(__name__)  # a run's ranks find this module, their target's, imported (gradcomp.launch.preload)


def train(rank: int, world: int, config: TrainConfig) -> dict[str, Any] | None:
    """One rank of a run, in an initialised process group; rank 0 returns the run record.

    Every rank builds the same task and model; each step every rank takes its shard of the global
    batch, DDP averages the gradients through the hook (or FSDP2 reduce-scatters them through it,
    ``--parallel fsdp``), and the optimizer steps.
    """
    device = _device(config.backend, rank)
    task = build_task(config.task, config.data)
    total = config.total_steps(task.steps_per_epoch(config.batch_size))
    torch.manual_seed(config.seed)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = task.build_model(config.model).to(device)
    resume = _resume_path(config)
    saved = checkpoint.load(resume, config, world, device) if resume else None
    spec = config.hook_spec
    placement = parallel.make(config.parallel, model, device, spec, config.sync_spec)
    used = config.effective  # the optimizer without the momentum a hook took over (momentum=true)
    parameters = placement.forward.parameters()
    optimizer = make_optimizer(used.optimizer, parameters, used.lr, used.momentum, used.weight_decay)
    state: TrainingHookState = placement.register(spec, config.seed, optimizer)
    schedule = make_schedule(optimizer, config.schedule, total, config.warmup_steps)
    torch.manual_seed(config.seed + 7919 * (rank + 1))  # each rank's own stream (dropout and the like)
    progress: dict[str, Any] = {"elapsed_s": 0.0, "wire_bytes": 0, "wire_estimated": False, "origin": time.time()}
    start = 0
    if saved is not None:
        progress, start = _restore(saved, config, rank, device, placement, state, optimizer, schedule)
        del saved
    record = _record(config, task, model, world, start if resume else None)
    writer: Writer = NullWriter()
    if rank == 0:
        runinfo.write(config.out, {**record, "status": "running"})
        writer = TensorBoardWriter(config.out, float(progress["origin"]), start if resume else None)
    # bytes across nodes: a checkpoint from before they were counted knows none
    across = progress.get("inter_node_bytes", 0.0 if start == 0 else None)
    meter = WireMeter(state, int(progress["wire_bytes"]), bool(progress["wire_estimated"]), across)

    def save(step: int, elapsed: float) -> None:
        hook_state = state.state_dict()  # first: a synchronizer completes what is in flight, which the meter counts
        meter.collect()
        progress.update(elapsed_s=elapsed, wire_bytes=meter.total, wire_estimated=meter.estimated,
                        inter_node_bytes=meter.across)  # fmt: skip
        _save(config, placement, optimizer, schedule, hook_state, device, step, world, progress)
        writer.flush()

    loop = Loop(config, task, placement, optimizer, schedule, meter, writer, rank, world, device, total, save)
    try:
        result, status = _run(loop, start, float(progress["elapsed_s"]), state, save)
        if status == "finished":
            final = {f"final/{k}": result[k] for k in result if k.startswith("eval_") or k in HPARAM_METRICS}
            writer.hparams(_hparams(config, world), final, loop.step, loop.elapsed)
    finally:
        writer.close()
    if rank != 0:
        return None
    record.update(status=status, metrics=result, ended=runinfo.now())
    runinfo.write(config.out, record)
    return record


def _restore(
    saved: dict[str, Any],
    config: TrainConfig,
    rank: int,
    device: torch.device,
    placement: parallel.AnyPlacement,
    state: TrainingHookState,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LambdaLR,
) -> tuple[dict[str, Any], int]:
    """Load a checkpoint into the run's parts; its progress and the step it resumes at."""
    placement.load(saved, optimizer)
    state.load_state_dict(saved["hooks"][rank])
    schedule.load_state_dict(saved["scheduler"])
    checkpoint.set_rng_state(saved["rng"][rank], device)
    if saved["config"].get("steps") != config.steps and config.schedule != "constant":
        logger.warning("resuming with a different length changes the %s schedule from here on", config.schedule)
    return dict(saved["progress"]), int(saved["step"])


def _run(
    loop: Loop, start: int, elapsed: float, state: TrainingHookState, save: Callable[[int, float], None]
) -> tuple[dict[str, Any], str]:
    """Train from ``start`` to the loop's end, checkpoint, and say whether the run finished or stopped."""
    try:
        result = loop.run(start, elapsed)
    except RuntimeError as error:
        if state.error is not None:  # DDP's backward carried only its text: raise gradcomp's own error
            raise state.error from error
        raise
    save(loop.step, loop.elapsed)
    if loop.step < loop.total:
        return result, "stopped"
    result["compute_ms"] = loop.compute_ms()  # after the last checkpoint: it changes nothing saved
    return result, "finished"


HPARAM_METRICS = ("train_loss", "wire_bytes", "compression_ratio", "train_time_s", "steps_per_s")
"""Final metrics shown in TensorBoard's HParams dashboard (as ``final/<name>``), besides every ``eval_*``."""


def _device(backend: str, rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _resume_path(config: TrainConfig) -> str | None:
    return checkpoint.resume_path(config)


def _save(
    config: TrainConfig,
    placement: parallel.AnyPlacement,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LambdaLR,
    hook_state: dict[str, Any],
    device: torch.device,
    step: int,
    world: int,
    progress: dict[str, Any],
) -> None:
    """A checkpoint, with every rank's hook and generator state (a collective: all ranks call it)."""
    hook_states = checkpoint.gather(hook_state)
    rng = checkpoint.gather(checkpoint.rng_state(device))
    model, optimizer_state = placement.model_state(), placement.optimizer_state(optimizer)  # FSDP2's gather here
    if dist.get_rank() == 0:
        checkpoint.save(
            config.checkpoint_path,
            {
                "step": step,
                "world_size": world,
                "config": config.to_dict(),
                "model": model,
                "optimizer": optimizer_state,
                "scheduler": schedule.state_dict(),
                "hooks": hook_states,
                "rng": rng,
                "progress": progress,
            },
        )


def _record(config: TrainConfig, task: Any, model: nn.Module, world: int, resumed_from: int | None) -> dict[str, Any]:
    previous = runinfo.read(config.out) if resumed_from is not None else None
    return {
        "name": os.path.basename(os.path.normpath(config.out)),
        "config": config.to_dict(),
        "world_size": world,
        "task": {
            "name": task.name,
            "kind": task.kind,
            "model": config.model or task.default_model,
            "parameters": parameter_count(model),
            "headline": _headline(task),
            **task.info,
        },
        "environment": runinfo.environment(world, config.backend, config.network, config.threads),
        "started": (previous or {}).get("started", runinfo.now()),
        "resumed_from": resumed_from,
    }


def _headline(task: Any) -> str:
    """The final metric a summary shows for this task (a key of the run's ``metrics``)."""
    return str(task.metric) if not task.evaluates else f"eval_{task.metric}"


def _hparams(config: TrainConfig, world: int) -> dict[str, Any]:
    """The settings shown in TensorBoard's HParams dashboard (what a run computes, not how it is driven)."""
    skip = {*PATH_FIELDS, "ranks", "log_every", "eval_every", "checkpoint_every", "group_timeout"}
    values = {k: ("" if v is None else v) for k, v in config.to_dict().items() if k not in skip}
    return {**values, "world_size": world}


# -- launching ----------------------------------------------------------------------------------


def launch(config: TrainConfig, *, verbose: bool = False) -> dict[str, Any]:
    """Start ``config.ranks`` ranks on this machine (behind ``config.network``), run, return rank 0's
    run record. A failure is recorded in run.json (status ``failed``) and raised (``RankError``, or
    ``NetemError`` where the network cannot be built). An output directory that holds another run
    is refused first (``runinfo.prepare``), and so is a batch the task's data cannot serve or a resume
    the checkpoint cannot serve (other settings, world size: before any rank starts, the run left as it
    was), and a directory another run is writing (it holds ``OUT/.run.lock``: two ``--resume auto`` at
    once). SIGTERM (or Ctrl-C) stops the ranks, records the run ``interrupted`` and raises
    :class:`Terminated` (``KeyboardInterrupt``)."""
    check_batch(config)
    checkpoint.check_before_start(config)  # the ranks it starts are the world: config.ranks
    name = os.path.basename(os.path.normpath(config.out))
    with runinfo.lock(config.out), _sigterm_raises():  # one run at a time in a directory
        runinfo.prepare(config.out, config.checkpoint_path, config.resume, config.overwrite)
        try:
            results = spawn(
                config.ranks,
                _rank_main,
                (config, verbose),
                timeout=config.timeout,
                backend=config.backend,
                group_timeout=config.group_timeout,
                threads=config.threads,
                network=config.network,
            )
        except (RankError, NetemError) as error:
            recorded = error.report if isinstance(error, RankError) else str(error)  # every rank's traceback
            runinfo.record_failure(config.out, name, config.to_dict(), recorded)
            raise
        except (Terminated, KeyboardInterrupt) as error:  # spawn stopped the ranks on its way out
            runinfo.record_failure(config.out, name, config.to_dict(), str(error) or "interrupted", "interrupted")
            raise
    record: dict[str, Any] = results[0]
    return record


class Terminated(BaseException):
    """SIGTERM reached the process that started a run's ranks (:func:`launch`): the ranks are
    stopped and run.json says ``interrupted``. Not an ``Exception``: nothing on the way out takes it
    for a failure to handle."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread while the block runs (elsewhere, or
    off the main thread, it keeps its handler: the default ends the process, and the ranks with it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated(f"interrupted by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rank_main(rank: int, world: int, config: TrainConfig, verbose: bool) -> dict[str, Any] | None:
    if verbose and rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    return train(rank, world, config)


def _torchrun(config: TrainConfig) -> dict[str, Any] | None:
    """Under torchrun: join the group it describes (RANK, WORLD_SIZE, MASTER_ADDR, ...) and train."""
    if config.network != "loopback":
        raise ValueError("--network emulates links between ranks started here; under torchrun the network is real")
    dist.init_process_group(config.backend, timeout=_timedelta(config.group_timeout))
    rank = dist.get_rank()
    try:
        torch.set_num_threads(config.threads)
        return train(rank, dist.get_world_size(), config)
    except BaseException:
        if rank == 0:
            name = os.path.basename(os.path.normpath(config.out))
            runinfo.record_failure(config.out, name, config.to_dict(), traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _summary(error: RankError | NetemError) -> str:
    return error.summary if isinstance(error, RankError) else " ".join(str(error).split())


def _failed(prog: str, error: BaseException) -> int:
    """Report ``error`` of this process (under torchrun: of this rank) and return the exit status: the
    message first, in one line (a user's error: only that, status 2; any other: then its traceback,
    status 1). Under torchrun the message also goes to the error file torchrun reads (its summary then
    shows it instead of a link about enabling tracebacks)."""
    user = is_user_error(error)
    where = "" if "RANK" not in os.environ else f"rank {os.environ['RANK']} of {os.environ.get('WORLD_SIZE')}: "
    line = f"{prog}: error: {where}{error if user else one_line(error)}"
    sys.stderr.write(line + "\n" + ("" if user else traceback.format_exc()))
    _tell_torchrun(line, None if user else traceback.format_exc())
    return 2 if user else 1


def _tell_torchrun(message: str, trace: str | None) -> None:
    """Write ``message`` (then ``trace``, where there is one) to the error file torchrun names in
    ``TORCHELASTIC_ERROR_FILE``, in the form of torch.distributed.elastic's ``ErrorHandler``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    shown = message if trace is None else f"{message}\n{trace}"
    extra = {"py_callstack": shown, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as file:
            json.dump({"message": {"message": message, "extraInfo": extra}}, file)
    except OSError:  # a summary without the message is no reason to fail otherwise
        logger.debug("could not write torchrun's error file %s", path)


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def command_parser() -> argparse.ArgumentParser:
    """The command line of a training run: one option per field of :class:`TrainConfig`."""
    parser = argparse.ArgumentParser(
        prog="gradcomp.experiments.train",
        description="Train with DDP and a gradcomp hook (under torchrun, or starting --ranks here).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command; its exit status. A user's error is one line on stderr (status 2): before any rank
    starts, as the same error of every rank started here, or, under torchrun, as each rank's first
    line (and the message torchrun's summary shows for it). Other failures: a line, then the tracebacks."""
    parser = command_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config = from_args(args)
        if not under_torchrun:
            netem.check(config.network, config.ranks)
            record = launch(config, verbose=args.verbose)
        else:
            check_batch(config)  # every rank, before rank 0 claims the directory
            first = int(os.environ["RANK"]) == 0
            with runinfo.lock(config.out) if first else contextlib.nullcontext():  # rank 0 holds the run's
                if first:
                    runinfo.prepare(config.out, config.checkpoint_path, config.resume, config.overwrite)
                maybe = _torchrun(config)
            if maybe is None:
                return 0
            record = maybe
    except (RankError, NetemError) as error:
        where = f"recorded in {runinfo.path(config.out)}"
        if isinstance(error, RankError) and error.user_error:
            sys.stderr.write(f"{parser.prog}: error: {error}; {where}\n")
            return 2
        details = f"{error.report}\n" if isinstance(error, RankError) else ""  # every rank's traceback
        sys.stderr.write(f"{parser.prog}: the run failed ({where}): {_summary(error)}\n{details}")
        return 1
    except Terminated as error:  # SIGTERM: the ranks stopped, the run recorded interrupted
        sys.stderr.write(f"{parser.prog}: {error}; recorded in {runinfo.path(config.out)}\n")
        return 128 + signal.SIGTERM
    except Exception as error:
        if under_torchrun:
            return _failed(parser.prog, error)  # this rank's first line is the message
        if not is_user_error(error):
            raise  # a defect of this process's own: its traceback
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    metrics = record.get("metrics", {})
    headline = record["task"]["headline"]
    sys.stdout.write(
        f"{record['name']}: {record['status']} at step {metrics.get('step')}, {headline} "
        f"{metrics.get(headline, float('nan')):.4g}, {metrics.get('wire_bytes', 0) / 1e6:.1f} MB sent per rank, "
        f"{metrics.get('train_time_s', 0):.1f} s training; {config.out}\n"
    )
    return 0
