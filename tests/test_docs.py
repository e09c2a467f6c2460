"""Every snippet and config in the README and docs/ works as written.

Each ``python`` block is preceded by a marker that says how it runs:

- ``<!-- runnable -->``: as a script (``python snippet.py`` in its own temporary directory, with the
  tutorial's example package, ``examples/tophalf``, on the path), in a process forked from
  gradcomp's fork server, which imported torch and gradcomp once: the snippet's own globals and
  ``__name__ == "__main__"``, as in a fresh interpreter, without the 2 to 3 s a fresh one costs;
- ``<!-- runnable with torchrun -->``: on 2 ranks, as under ``torchrun --nproc-per-node 2`` (the ranks
  are started as the other distributed tests start theirs, with the process group initialized: the
  snippet's own ``init_process_group`` call is then a no-op; torchrun itself is left out because a
  process with gloo groups sometimes aborts at exit here, "terminate called without an active
  exception", even plain DDP without gradcomp);
- ``<!-- runnable as root -->``: the same, where emulated networks can be built (root, iproute2);
- ``<!-- sketch -->``: an interface at a glance, not a program (its names are the reader's).

Every ``toml`` block is a sweep config, checked as ``gradcomp sweep --dry-run`` checks it; every
``gradcomp``, ``python -m gradcomp...`` and ``torchrun ... experiments/train.py`` line of a ``sh``
block parses with that command's own parser (nothing is run: some take hours).
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradcomp import netem
from gradcomp.cli import command_parser
from gradcomp.experiments.sweep import command as sweep_command
from gradcomp.experiments.sweep import plan
from gradcomp.experiments.training import run as training_run
from gradcomp.launch import rank_context
from tests.distributed import spawn_ranks

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("runnable", "runnable with torchrun", "runnable as root", "sketch")
BLOCK = re.compile(r"(?:<!-- (?P<marker>[a-z ]+) -->\n)?```(?P<language>\w+)\n(?P<code>.*?)```", re.S)


def blocks(language: str) -> list[tuple[str, str | None, str]]:
    """(where, marker, code) of every fenced block in ``language``."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            if match["language"] == language:
                where = f"{path.relative_to(ROOT)}:{text[: match.start('language')].count(chr(10)) + 1}"
                found.append((where, match["marker"], match["code"]))
    return found


PYTHON = blocks("python")


@pytest.mark.parametrize(("where", "marker", "code"), PYTHON, ids=[b[0] for b in PYTHON])
def test_every_python_block_is_marked(where: str, marker: str | None, code: str) -> None:
    assert marker in MARKERS, f"{where}: mark the block with one of {MARKERS} (<!-- ... --> on the line before)"


RUNNABLE = [b for b in PYTHON if b[1] in ("runnable", "runnable with torchrun", "runnable as root")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("where", "marker", "code"), RUNNABLE, ids=[b[0] for b in RUNNABLE])
def test_runnable_python_blocks_run(where: str, marker: str, code: str, tmp_path: Path) -> None:
    if marker == "runnable as root" and netem.unavailable():
        pytest.skip(netem.unavailable())
    if marker == "runnable with torchrun":
        spawn_ranks(2, run_snippet, (code, str(tmp_path)), timeout=200)
        return
    script = tmp_path / "snippet.py"
    script.write_text(code)
    output = tmp_path / "output.txt"
    process = rank_context().Process(target=run_script, args=(str(script), str(output)))
    process.start()
    process.join(timeout=200)
    if process.is_alive():
        process.kill()  # past the deadline: the exit code says killed
        process.join()
    written = output.read_text() if output.exists() else ""
    assert process.exitcode == 0, f"{where} failed (exit code {process.exitcode}):\n{written[-5000:]}"


def run_script(script: str, output: str) -> None:
    """Inside a process of the fork server: ``python <script>`` from the script's directory, its output
    (the process's own, its children's too) into ``output``; raising ends the process with exit code 1."""
    directory = os.path.dirname(script)
    os.chdir(directory)
    # examples/tophalf on the path, as `pip install -e examples/tophalf` puts it (docs/your-compressor.md)
    sys.path[:0] = [directory, str(ROOT / "examples" / "tophalf")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "examples" / "tophalf"), str(ROOT)) if p)
    sys.argv = [script]
    written = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(written, 1)
    os.dup2(written, 2)
    runpy.run_path(script, run_name="__main__")


TORCHRUN = [b for b in PYTHON if b[1] == "runnable with torchrun"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("where", "marker", "code"), TORCHRUN, ids=[b[0] for b in TORCHRUN])
def test_torchrun_snippets_run_under_torchrun(where: str, marker: str, code: str, tmp_path: Path) -> None:
    """The same snippets under real ``torchrun`` (``make test-slow``: about 5 s each), exit included."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, f"{where} under torchrun:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"


def run_snippet(rank: int, world: int, code: str, directory: str) -> None:
    """Inside each rank: the snippet as a program, in ``directory``, its process group already up."""
    import torch.distributed as dist

    os.chdir(directory)
    # the group is the test's (already initialized, and kept for the next snippet)
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        exec(compile(code, "snippet", "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy  # type: ignore[assignment]


TOML = blocks("toml")


@pytest.mark.parametrize(("where", "marker", "code"), TOML, ids=[b[0] for b in TOML])
def test_sweep_configs_in_the_docs_are_valid(where: str, marker: str | None, code: str, tmp_path: Path) -> None:
    runs = plan.expand(tomllib.loads(code), str(tmp_path / "out"), where=where)
    assert runs


def _example(path: str) -> Any:
    """An example script of the repository as a module (its ``command_parser``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example", ROOT / path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_lines() -> list[tuple[str, str]]:
    """(where, line) of every command line of the ``sh`` blocks, continuations joined."""
    lines = []
    for where, _, code in blocks("sh"):
        for line in code.replace("\\\n", " ").splitlines():
            if line.strip():
                lines.append((where, line.strip()))
    return lines


LINES = command_lines()


@pytest.mark.parametrize(("where", "line"), LINES, ids=[f"{w}:{i}" for i, (w, _) in enumerate(LINES)])
def test_command_lines_in_the_docs_parse(where: str, line: str) -> None:
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # the environment of the command
        words = words[1:]
    if words[:2] == ["gradcomp", "--version"]:
        with pytest.raises(SystemExit) as exit_info:
            command_parser().parse_args(words[1:])
        assert exit_info.value.code == 0
    elif words[:1] == ["gradcomp"]:
        arguments = command_parser().parse_args(words[1:])
        assert arguments.run is not None, f"{where}: {line}"
    elif words[:3] == ["python", "-m", "gradcomp.experiments.train"]:
        training_run.command_parser().parse_args(words[3:])
    elif words[:3] == ["python", "-m", "gradcomp.experiments.faults"]:
        from gradcomp.experiments import faults

        options = vars(faults.command_parser().parse_args(words[3:]))
        options.pop("seeds")
        for hook in options.pop("hook") or [faults.FaultConfig.hook]:  # --hook repeated: a study per method
            faults.FaultConfig(**options, hook=hook)
    elif words[:3] == ["python", "-m", "gradcomp.experiments.bench.fault_tolerant"]:
        from gradcomp.experiments.bench import fault_tolerant

        fault_tolerant.command_parser().parse_args(words[3:])
    elif words[:3] == ["python", "-m", "gradcomp.experiments.sweep"]:
        sweep_command.command_parser().parse_args(words[3:])
    elif words[:1] == ["torchrun"]:
        script = next(i for i, w in enumerate(words) if w.endswith(".py") or w == "-m")
        skip = 2 if words[script] == "-m" else 1
        parser = _example(words[script]).command_parser() if words[script].startswith("examples/") else None
        (parser or training_run.command_parser()).parse_args(words[script + skip :])
    elif words[:1] == ["torchft_lighthouse"]:  # its flags as torchft's own command lists them
        listed = subprocess.run([str(Path(sys.executable).parent / words[0]), "--help"], capture_output=True,
                                text=True, timeout=30).stdout  # fmt: skip
        assert all(w in listed for w in words[1:] if w.startswith("--")), f"{where}: {line}"
    elif words[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        launch_command_parser().parse_args(words[2:])
    else:
        assert words[0] in ("make", "tensorboard", ".", "pip"), f"{where}: a command this test does not know: {line}"
