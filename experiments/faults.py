"""A fault study: replica groups on torchft that lose one group mid-run, beside a fault-free twin.

    python -m gradcomp.experiments.faults --groups 3 --task digits --hook topk:ratio=0.01,ef=true \\
        --steps 800 --kill 2 --at 200 --restart-after 100 --out runs/faults/topk

Each replica group is one process on this machine (on loopback, or with ``--network 100mbit`` and
the like each in a network namespace of its own behind an emulated link), under a torchft
lighthouse that the command serves, with its own torchft ``Manager`` and store; every step each group trains on its
shard of the global batch and gradcomp's fault-tolerant hook averages the gradients over the
quorum's groups (``--sync diloco:...``: gradcomp's DiLoCo on the manager instead, the hook spec then
the outer gradients'). In the faulted run, group ``--kill`` kills itself (SIGKILL) when the groups'
step reaches ``--at`` (with a delayed DiLoCo: just after a synchronization started, its fragment in
flight), and the command starts it again once the others have trained ``--restart-after`` more
steps; it heals from a live group and rejoins. Steps are inner steps: under the hook every one is
committed, under a synchronizer every ``every / fragments``-th (its synchronizations). The
fault-free twin runs the same configuration without the kill.

Writes, per run (``faulted/`` and ``fault-free/`` under ``--out``): each group's steps and
evaluations as JSON lines (``group<g>.jsonl``, flushed line by line: a killed group's lines up to
its death stay), TensorBoard events per group (``eval/accuracy``, ``train/loss``,
``time/step_ms``, ``comm/participants``, against committed steps), and ``summary.json``: per run,
the final accuracy, the wall time, the survivors' steps lost (attempted, not committed), their
median step time before, during and after the loss (a step is "during" when fewer groups than all
took part), the bytes each group sent, and whether every survivor's record holds every committed
step once. The command prints the comparison and writes ``report.html`` beside them: both runs'
accuracy against step and time and the groups taking part, the kill and restart marked
(:mod:`gradcomp.experiments.report.faults`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradcomp import netem
from gradcomp.engine.spec import HookSpec
from gradcomp.experiments.sweep.plan import slug
from gradcomp.hooks.auto_spec import AutoSpec, is_auto_spec
from gradcomp.launch import rank_context
from gradcomp.sync.spec import SyncSpec

RESTART_WAIT_S = 120.0
"""The longest the command waits for the killed group to die, or for the others to go on."""


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """One fault study (the command's options)."""

    out: str
    groups: int = 3
    task: str = "digits"
    model: str | None = None
    hook: str = "topk:ratio=0.01,ef=true"
    sync: str | None = None
    steps: int = 800
    batch_size: int = 96
    lr: float = 0.1
    seed: int = 0
    kill: int = 2
    at: int = 200
    restart_after: int = 100
    min_groups: int = 0
    """The fewest groups a step commits with (torchft's ``min_replica_size``); 0: all but one."""
    eval_every: int = 25
    step_ms: float = 20.0
    """The least an inner step takes (it waits out the rest): a real model's compute, so that a
    group's restart (seconds: starting Python, torch, the compressor's compiled kernels) spans as
    many steps as it would in a real run, not thousands of the digits' 1 ms steps."""
    network: str = "loopback"
    """Where the groups talk: ``loopback``, or an emulated network (a ``gradcomp.netem`` profile:
    ``1gbit``, ``100mbit``...; each group in a namespace of its own, the lighthouse in one more)."""
    timeout: float = 10.0
    """torchft's timeout for collectives, quorums and healing, in seconds: what a lost group costs."""
    twin: bool = True

    def __post_init__(self) -> None:
        if self.sync is not None or not is_auto_spec(self.hook):  # auto averages under the hook only
            HookSpec.parse(self.hook)
        else:
            AutoSpec.parse(self.hook)
        if self.sync is not None:
            SyncSpec.parse(self.sync)
        if self.groups < 2:
            raise ValueError(f"--groups must be >= 2 (one is lost), got {self.groups}")
        if not 0 <= self.kill < self.groups:
            raise ValueError(f"--kill must name a group 0..{self.groups - 1}, got {self.kill}")
        if not 0 < self.at < self.steps:
            raise ValueError(f"--at must be a step inside the run (1..{self.steps - 1}), got {self.at}")
        netem.parse(self.network)  # a profile's mistakes, before anything starts
        if self.step_ms < 0:
            raise ValueError(f"--step-ms must be >= 0, got {self.step_ms}")
        if self.restart_after < 1:
            raise ValueError(f"--restart-after must be >= 1 step, got {self.restart_after}")
        if self.batch_size < self.groups:
            raise ValueError(f"--batch-size ({self.batch_size}) must give every group a sample")
        if not 0 <= self.min_groups < self.groups:
            raise ValueError(f"--min-groups must be 0..{self.groups - 1} (one group is lost), got {self.min_groups}")

    @property
    def quorum(self) -> int:
        return self.min_groups or self.groups - 1

    def commits(self, inner_steps: int) -> int:
        """The committed steps of ``inner_steps``: the same under the hook, synchronizations under a
        synchronizer (``--steps``, ``--at``, ``--restart-after`` and ``--eval-every`` count inner steps)."""
        return max(1, inner_steps // self.period)

    @property
    def period(self) -> int:
        """Inner steps per committed step: 1 under the hook, ``every / fragments`` under a synchronizer."""
        if self.sync is None:
            return 1
        spec = SyncSpec.parse(self.sync)
        return spec.every // spec.fragments


# -- one replica group ------------------------------------------------------------------------


def group_main(config: FaultConfig, group: int, place: tuple[str | None, str], lighthouse: str, folder: str,
               dies: bool, start: Any, progress: Any, finished: Any) -> None:  # fmt: skip
    """One replica group's process: train until the groups' committed step reaches ``config.steps``
    (for a synchronizer: its synchronizations), writing a line per step and per evaluation.
    ``place``: the group's network namespace (None: this machine's) and its address there."""
    namespace, address = place
    if namespace is not None:  # first, before any thread: a thread keeps its creator's namespace
        netem.enter(namespace)
        os.environ["GLOO_SOCKET_IFNAME"] = netem.INTERFACE
    import torchft
    import torchft.optim

    from gradcomp.experiments.replicas import one_rank_group
    from gradcomp.experiments.tasks import build_task
    from gradcomp.hooks import fault_tolerant as ft_hooks
    from gradcomp.sync import fault_tolerant as ft_sync

    torch.set_num_threads(1)
    task = build_task(config.task)
    torch.manual_seed(config.seed)  # every group the same initial model
    model = task.build_model(config.model)
    manager = one_rank_group(f"group{group}", lighthouse, min_groups=config.quorum, timeout=config.timeout,
                             synchronous=config.sync is not None, address=address)  # fmt: skip
    inner = torch.optim.SGD(model.parameters(), lr=config.lr)
    if config.sync is None:
        trained: Any = ft_hooks.DistributedDataParallel(manager, model, config.hook)
        optimizer: Any = torchft.optim.OptimizerWrapper(manager, inner)
        manager.register_state_dict_fn("model", trained.load_state_dict, trained.state_dict)
        outer = None
    else:
        trained, optimizer = model, inner
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        outer = ft_sync.FaultTolerantSynchronizer(manager, model, config.sync, config.hook, optimizer=inner)
    manager.register_state_dict_fn("optim", inner.load_state_dict, inner.state_dict)
    if start is not None:
        start.wait()  # the first run of every group begins together: the first quorum holds all
    lines = open(Path(folder) / f"group{group}.jsonl", "a", buffering=1)  # noqa: SIM115 - open to the end
    began = time.monotonic()

    def write(entry: dict[str, Any]) -> None:
        lines.write(json.dumps({**entry, "group": group, "time": time.monotonic() - began, "pid": os.getpid()}) + "\n")

    try:
        attempted, inner_steps = _train(config, group, task, model, trained, optimizer, inner, outer, manager, dies,
                                        progress, write)  # fmt: skip
    except Exception:
        if start is not None or not finished.value:
            raise
        # a restarted group that the others did not wait for: they finished before it could rejoin
        write({"kind": "end", "committed": manager.current_step(), "attempted": 0, "sent_bytes": 0.0,
               "inner_steps": 0, "rejoined": False})  # fmt: skip
        lines.close()
        manager.shutdown()
        return
    finished.value = 1  # a group restarted too late for the others then stops at its quorum's timeout
    sent = _sent_bytes(trained, outer)
    write({"kind": "end", "committed": manager.current_step(), "attempted": attempted, "sent_bytes": sent,
           "inner_steps": inner_steps, "chosen": _chosen(trained)})  # fmt: skip
    lines.close()
    manager.shutdown()


def _train(config: FaultConfig, group: int, task: Any, model: torch.nn.Module, trained: Any, optimizer: Any,
           inner: torch.optim.Optimizer, outer: Any, manager: Any, dies: bool, progress: Any,
           write: Any) -> tuple[int, int]:  # fmt: skip
    """The group's steps until the committed step reaches ``config.steps``; returns the steps
    attempted and the inner steps taken."""
    attempted, inner_steps, evaluated_at = 0, 0, -1
    in_flight_death = outer is not None and outer.sync.delay > 0  # else between synchronizations
    last, dies_at, every = config.commits(config.steps), config.commits(config.at), config.commits(config.eval_every)
    while manager.current_step() < last:
        committed = manager.current_step()
        if dies and committed >= dies_at and (not in_flight_death or outer.in_flight):
            os.kill(os.getpid(), signal.SIGKILL)  # with a delayed synchronizer: its fragment in flight
        index = committed * config.period + (outer.phase if outer is not None else 0)
        x, y = task.batch(index, config.batch_size, config.seed)
        x, y = x[group :: config.groups], y[group :: config.groups]
        step_began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(trained(x), y)
        loss.backward()
        if outer is None:
            ok = manager.should_commit()
            if ok:
                inner.step()
            participants = manager.num_participants()
        else:
            failures = outer.failures
            inner.step()
            outer.step()
            ok = outer.failures == failures  # a step is lost where a synchronization failed
            participants = outer.world or None  # None before the first synchronization
        spent = time.perf_counter() - step_began
        if spent < config.step_ms / 1e3:
            time.sleep(config.step_ms / 1e3 - spent)
        attempted, inner_steps = attempted + 1, inner_steps + 1
        write({"kind": "step", "committed": manager.current_step(), "ok": ok, "loss": float(loss),
               "participants": participants, "busy_ms": 1e3 * spent,
               "step_ms": 1e3 * (time.perf_counter() - step_began)})  # fmt: skip
        now = manager.current_step()
        if group != config.kill:
            progress.value = max(progress.value, now)
        due = now % every == 0 or now >= last
        if now and now != evaluated_at and due:  # not before the first commit (a restarted group: healed)
            evaluated_at = now
            write({"kind": "eval", "committed": now, **_evaluate(task, model, outer)})
    return attempted, inner_steps


def _serve_lighthouse(namespace: str, quorum: int, ports: Any, stop: Any) -> None:
    """A lighthouse in its own namespace of an emulated network, until ``stop`` is set (it outlives
    any group's death)."""
    netem.enter(namespace)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=quorum, join_timeout_ms=1000)
    ports.put(int(server.address().rsplit(":", 1)[1]))
    stop.wait()
    server.shutdown()


@torch.no_grad()
def _evaluate(task: Any, model: torch.nn.Module, outer: Any) -> dict[str, float]:
    """The task's metrics on its whole evaluation set (DiLoCo: of the global parameters)."""
    x, y = task.eval_set()
    if outer is None:
        return task.eval_metrics(task.eval_sums(model(x), y).double())
    with outer.global_model() as synchronized:
        return task.eval_metrics(task.eval_sums(synchronized(x), y).double())


def _chosen(trained: Any) -> list[str] | None:
    """``auto``'s candidates in use at the end (a restarted group's: the decision it was sent)."""
    state: Any = getattr(trained, "gradcomp_state", None)
    if not hasattr(state, "choice"):
        return None
    return sorted({str(state.candidates[c]) for c in state.choice.values()} or {str(state.candidates[0])})


def _sent_bytes(trained: Any, outer: Any) -> float | None:
    """What this group's engines sent, across quorums; None where a step's bytes are not counted
    (a native all-reduce's travel inside the backend)."""
    averaged = outer.engines if outer is not None else trained.gradcomp_state  # either: steps across quorums
    sent = [step.sent_bytes for step in averaged.steps_since(0)]
    return None if any(b is None for b in sent) else float(sum(sent))


# -- the command: a run, its twin, the comparison ------------------------------------------------


def run(config: FaultConfig, folder: Path, faulted: bool) -> dict[str, Any]:
    """One run of ``config.groups`` groups under a lighthouse served here; with ``faulted``, group
    ``config.kill`` dies at ``config.at`` and is started again ``config.restart_after`` steps later."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("group*.jsonl"):
        old.unlink()
    context = rank_context()
    start, progress, finished = context.Barrier(config.groups), context.Value("i", 0), context.Value("i", 0)
    with contextlib.ExitStack() as stack:
        places, address = _network(config, context, stack)

        def group(g: int, dies: bool, first: bool) -> Any:
            arguments = (config, g, places[g], address, str(folder), dies, start if first else None, progress, finished)
            return context.Process(target=group_main, args=arguments)

        return _run(config, folder, faulted, group, progress)


Place = tuple[str | None, str]
"""A group's network namespace (None: this machine's) and its address there."""


def _network(config: FaultConfig, context: Any, stack: contextlib.ExitStack[Any]) -> tuple[list[Place], str]:
    """Each group's place (namespace, address) and the lighthouse's address, served for the ``with``
    block: on loopback here, on an emulated network in a namespace of its own."""
    from torchft.coordination import LighthouseServer

    profile = netem.check(config.network, config.groups + 1)
    if not profile.emulated:
        server = LighthouseServer(bind="[::]:0", min_replicas=config.quorum, join_timeout_ms=1000)
        stack.callback(server.shutdown)
        return [(None, "localhost")] * config.groups, server.address()
    net = stack.enter_context(netem.EmulatedNetwork(config.groups + 1, profile))
    ports, stop = context.Queue(), context.Event()
    served = context.Process(target=_serve_lighthouse, args=(net.namespace(config.groups), config.quorum, ports, stop))
    served.start()
    stack.callback(served.join, 10)
    stack.callback(stop.set)
    port = ports.get(timeout=60)
    places: list[Place] = [(net.namespace(g), net.address(g)) for g in range(config.groups)]
    return places, f"http://{net.address(config.groups)}:{port}"


def _run(config: FaultConfig, folder: Path, faulted: bool, group: Any, progress: Any) -> dict[str, Any]:
    """The groups of a run started (``group(g, dies, first)`` makes one's process), the killed one
    started again, all waited for; the run's summary."""
    processes = [group(g, faulted and g == config.kill, True) for g in range(config.groups)]
    began = time.monotonic()
    restarted_at = killed_at = None
    deadline = began + RESTART_WAIT_S + config.steps * 0.5  # generous: a bound against a hang, not a budget
    try:
        for process in processes:
            process.start()
        if faulted:
            killed = processes[config.kill]
            killed.join(timeout=RESTART_WAIT_S + config.steps)
            if killed.exitcode != -signal.SIGKILL:
                raise RuntimeError(f"group {config.kill} was to die by SIGKILL; its exit code: {killed.exitcode}")
            died = killed_at = progress.value
            while progress.value < died + config.commits(config.restart_after) and time.monotonic() < deadline:
                if not any(p.is_alive() for p in processes):
                    break
                time.sleep(0.05)
            restarted_at = progress.value
            processes.append(group(config.kill, False, False))
            processes[-1].start()
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
        stuck = [p.pid for p in processes if p.is_alive()]
        if stuck:
            raise RuntimeError(f"groups still running past the deadline (pids {stuck}): a hang")
        failed = [p.exitcode for p in processes if p.exitcode not in (0, -signal.SIGKILL)]
        if failed:
            raise RuntimeError(f"a group failed (exit codes {failed}); its output is in {folder}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    summary = summarize(config, folder, faulted)
    summary.update(wall_s=time.monotonic() - began, killed_at=killed_at, restarted_at=restarted_at)
    _write_tensorboard(folder)
    return summary


def read_lines(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Each group's lines, in the order written (a restarted group's after its first life's)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("group*.jsonl")):
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if entries:
            groups[entries[0]["group"]] = entries
    return groups


def summarize(config: FaultConfig, folder: Path, faulted: bool) -> dict[str, Any]:
    """A run's figures from its groups' lines (the module's notes)."""
    groups = read_lines(folder)
    survivors = [g for g in groups if not (faulted and g == config.kill)]
    steps = {g: [e for e in groups[g] if e["kind"] == "step"] for g in groups}
    ends = {g: next((e for e in reversed(groups[g]) if e["kind"] == "end"), None) for g in groups}
    evaluations = {g: [e for e in groups[g] if e["kind"] == "eval"] for g in groups}
    final = {g: evaluations[g][-1]["accuracy"] if evaluations[g] else None for g in groups}
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for g in survivors:
        lost_seen, whole = False, True
        for entry in steps[g]:
            if entry["participants"] is not None:  # else as the step before (no synchronization yet)
                whole = entry["participants"] >= config.groups
            lost_seen = lost_seen or not whole
            phases["after" if whole and lost_seen else "before" if whole else "during"].append(entry["busy_ms"])
    last = config.commits(config.steps)
    whole_record = all(
        sorted({e["committed"] for e in steps[g]}) == list(range(steps[g][0]["committed"], last + 1))
        for g in survivors
        if steps[g]
    )
    return {
        "faulted": faulted,
        "final_accuracy": final,
        "committed": {g: None if (end := ends[g]) is None else end["committed"] for g in groups},
        "steps_lost": {g: sum(not e["ok"] for e in steps[g]) for g in survivors},
        "step_ms": {name: statistics.median(values) if values else None for name, values in phases.items()},
        "longest_step_ms_during_loss": max(phases["during"], default=None),
        "steps_during_loss": len(phases["during"]) // max(1, len(survivors)),
        "sent_mb": {
            g: None if (end := ends[g]) is None or end["sent_bytes"] is None else end["sent_bytes"] / 1e6
            for g in groups
        },
        "survivors_recorded_every_step": whole_record,
        "auto_chose": {g: end.get("chosen") for g in groups if (end := ends[g]) is not None and end.get("chosen")},
    }


def _write_tensorboard(folder: Path) -> None:
    """Each group's curves as TensorBoard scalars against committed steps (``folder/group<g>/``)."""
    from torch.utils.tensorboard import SummaryWriter

    for group, entries in read_lines(folder).items():
        writer = SummaryWriter(str(folder / f"group{group}"))
        for entry in entries:
            if entry["kind"] == "step":
                writer.add_scalar("train/loss", entry["loss"], entry["committed"], walltime=entry["time"])
                writer.add_scalar("time/step_ms", entry["step_ms"], entry["committed"], walltime=entry["time"])
                writer.add_scalar("time/busy_ms", entry["busy_ms"], entry["committed"], walltime=entry["time"])
                participants = entry["participants"]
                if participants is not None:  # known from a synchronizer's first synchronization on
                    writer.add_scalar("comm/participants", participants, entry["committed"], walltime=entry["time"])
            elif entry["kind"] == "eval":
                writer.add_scalar("eval/accuracy", entry["accuracy"], entry["committed"], walltime=entry["time"])
        writer.close()


def study(config: FaultConfig) -> dict[str, Any]:
    """The faulted run and (``config.twin``) its fault-free twin; ``summary.json`` under ``config.out``."""
    out = Path(config.out)
    results: dict[str, Any] = {"config": dataclasses.asdict(config)}
    if config.twin:
        results["fault-free"] = run(config, out / "fault-free", faulted=False)
    results["faulted"] = run(config, out / "faulted", faulted=True)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    return results


def accuracy(results: dict[str, Any], run: str, config: FaultConfig) -> float | None:
    """A run's final accuracy as the study reads it: the first group never killed's last evaluation."""
    return results[run]["final_accuracy"].get(0 if config.kill != 0 else 1)


def across_seeds(studies: dict[int, dict[str, Any]], config: FaultConfig) -> dict[str, Any]:
    """Per seed, the faulted run's final accuracy less its twin's (percentage points), and their mean
    with a 95% Student-t interval (scipy) where there are two seeds or more."""
    differences = {
        seed: 100 * (faulted - free)
        for seed, results in studies.items()
        if (faulted := accuracy(results, "faulted", config)) is not None
        and (free := accuracy(results, "fault-free", config)) is not None
    }
    values = list(differences.values())
    figures: dict[str, Any] = {"difference_pp": differences, "mean_pp": statistics.mean(values) if values else None,
                               "interval_pp": None, "largest_pp": max(map(abs, values), default=None)}  # fmt: skip
    if len(values) >= 2:
        from scipy import stats  # here: scipy.stats costs half a second at import

        spread = stats.sem(values)
        if spread > 0:
            low, high = stats.t.interval(0.95, len(values) - 1, loc=statistics.mean(values), scale=spread)
            figures["interval_pp"] = [float(low), float(high)]
        else:
            figures["interval_pp"] = [figures["mean_pp"], figures["mean_pp"]]
    return figures


def table(results: dict[str, Any], config: FaultConfig) -> str:
    """The comparison as a Markdown table (survivors' figures; accuracy of group 0's final evaluation)."""
    header = ("| run | final accuracy | survivors' steps lost | step ms before / during / after the loss "
              "(longest during) | steps during the loss | MB sent per survivor | wall s |")  # fmt: skip
    rows = [header, "|---|---|---|---|---|---|---|"]
    for name in ("fault-free", "faulted"):
        if name not in results:
            continue
        r = results[name]
        final = accuracy(results, name, config)
        shown = "-" if final is None else f"{final:.4f}"
        lost = max(r["steps_lost"].values(), default=0)
        ms = " / ".join("-" if v is None else f"{v:.1f}" for v in r["step_ms"].values())
        longest = r["longest_step_ms_during_loss"]
        ms += "" if longest is None else f" (longest {longest:.0f})"
        sent = [v for g, v in r["sent_mb"].items() if v is not None and not (r["faulted"] and g == config.kill)]
        mb = f"{statistics.mean(sent):.2f}" if sent else "-"
        rows.append(f"| {name} | {shown} | {lost} | {ms} | {r['steps_during_loss']} | {mb} | {r['wall_s']:.1f} |")
    return "\n".join(rows)


def auto_text(results: dict[str, Any]) -> str:
    """Per run, the candidates ``auto`` ended with on each group that finished ("" without auto)."""
    lines = []
    for name in ("fault-free", "faulted"):
        chose = results.get(name, {}).get("auto_chose")
        if chose:
            groups = ", ".join(str(g) for g in chose)
            alike = len({tuple(c) for c in chose.values()}) == 1
            said = ", ".join(next(iter(chose.values()))) if alike else str(chose)
            lines.append(f"{name}: auto ended with {said} (groups {groups})")
    return "\n".join(lines)


def command_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradcomp.experiments.faults", description=__doc__.split("\n\n")[0])
    defaults = FaultConfig(out="")
    for field in dataclasses.fields(FaultConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "out":
            parser.add_argument(flag, required=True, help="the study's folder")
        elif field.name == "hook":
            parser.add_argument(flag, action="append", help=f"the hook spec (default {defaults.hook}); repeated: "
                                "a study per method, each in a folder of its own, compared on one page")  # fmt: skip
        elif field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, field.name))
        else:
            kind = {"int": int, "float": float}.get(str(field.type), str)
            parser.add_argument(flag, type=kind, default=getattr(defaults, field.name))
    parser.add_argument("--seeds", help="several seeds (0,1,2): a study per seed, and the accuracy differences "
                        "across them with a 95%% interval")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = command_parser()
    args = vars(parser.parse_args(argv))
    seeds, hooks = args.pop("seeds"), args.pop("hook") or [FaultConfig.hook]
    out = Path(args.pop("out"))
    try:  # every method's configuration checked before anything runs
        configs = [FaultConfig(**args, hook=hook, out=str(out if len(hooks) == 1 else out / slug(hook)))
                   for hook in hooks]  # fmt: skip
        chosen = [int(s) for s in seeds.split(",")] if seeds else None
        if chosen is not None and not configs[0].twin:
            raise ValueError("--seeds compares each faulted run with its twin: not with --no-twin")
        if len(hooks) > 1 and not configs[0].twin:
            raise ValueError("several --hook compare each method's faulted run with its twin: not with --no-twin")
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    from gradcomp.experiments.report import faults as page  # matplotlib: the experiments extra

    methods = {config.hook: one_method(config, chosen, page) for config in configs}
    if len(methods) > 1:  # a sweep over methods: their accuracy differences side by side
        (out / "summary.json").write_text(json.dumps({"methods": methods}, indent=2))
        written = page.write_methods(out, methods, {config.hook: slug(config.hook) for config in configs})
        sys.stdout.write(page.methods_text(methods) + f"\n{written}\n")
    return 0


def one_method(config: FaultConfig, seeds: list[int] | None, page: Any) -> dict[str, Any]:
    """One method's study (one per seed with ``seeds``), its page and printed comparison; returns its
    accuracy differences across seeds (:func:`across_seeds`)."""
    if seeds is None:
        results = study(config)
        comparison = table(results, config)
        written = page.write(Path(config.out), results, comparison)
        chose = auto_text(results)
        sys.stdout.write(f"{comparison}\n{chose + chr(10) if chose else ''}{Path(config.out) / 'summary.json'}\n"
                         f"{written}\n")  # fmt: skip
        return across_seeds({config.seed: results}, config)
    studies = {}
    for seed in seeds:  # each seed a study of its own, with its page, in out/seed<S>
        one = dataclasses.replace(config, seed=seed, out=str(Path(config.out) / f"seed{seed}"))
        studies[seed] = study(one)
        page.write(Path(one.out), studies[seed], table(studies[seed], one))
    figures = across_seeds(studies, config)
    (Path(config.out) / "summary.json").write_text(json.dumps({"seeds": studies, "accuracy": figures}, indent=2))
    written = page.write_seeds(Path(config.out), studies, figures, config)
    sys.stdout.write(page.seeds_text(studies, figures, config) + f"\n{written}\n")
    return figures


if __name__ == "__main__":
    sys.exit(main())
