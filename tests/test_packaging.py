"""What installing gradcomp provides: one import name, its version, the shipped sweep configs, and
clear messages naming the extra where an optional dependency is missing."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from importlib.metadata import EntryPoint
from typing import Any

import pytest

import gradcomp
import gradcomp.experiments
import gradcomp.hooks
from gradcomp import cli
from gradcomp.cli import command_parser, main
from gradcomp.experiments.commands import SUMMARIES
from gradcomp.experiments.sweep import plan
from gradcomp.experiments.tasks import build_task


def test_one_import_name() -> None:
    assert gradcomp.hooks.__name__ == "gradcomp.hooks" and gradcomp.experiments.__name__ == "gradcomp.experiments"
    # from a directory other than the checkout, only gradcomp is importable
    code = "import importlib.util as u; print([n for n in ('hooks', 'experiments') if u.find_spec(n)])"
    found = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(f"gradcomp {gradcomp.__version__} ")


def test_shipped_configs_are_found_by_name() -> None:
    assert {"quick", "full"} <= set(plan.shipped())
    assert plan.find_config("quick").endswith("configs/quick.toml")
    with pytest.raises(ValueError, match=r"give a TOML file, or one of .*quick"):
        plan.find_config("quik")


def test_a_missing_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    with pytest.raises(ValueError, match=r"gradcomp\[experiments\]"):
        build_task("digits")


def test_a_missing_tqdm_names_the_extra() -> None:
    code = "import sys; sys.modules['tqdm'] = None; import gradcomp.experiments.sweep.runner"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0 and "pip install 'gradcomp[experiments]'" in run.stderr


def _commands(*commands: tuple[str, ...], missing: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], bool]:
    """Each ``gradcomp WORDS`` of ``commands`` in one fresh interpreter, the modules ``missing`` made
    unimportable: each one's exit code, stdout and stderr, and whether torch was imported."""
    code = f"""
import contextlib, io, json, sys
for name in {missing!r}:
    sys.modules[name] = None
from gradcomp.cli import main
answers = []
for words in {list(commands)!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(words))
        except SystemExit as exit:
            code = exit.code
    answers.append({{"code": code, "out": out.getvalue(), "err": err.getvalue()}})
print(json.dumps([answers, "torch" in sys.modules]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    answers, torch_imported = json.loads(done.stdout)
    return answers, torch_imported


def test_the_command_line_answers_without_importing_torch() -> None:
    answers, torch_imported = _commands(("--help",), ("bench", "--help"), ("--version",))
    assert not torch_imported
    assert all(answer["code"] == 0 and answer["out"] and not answer["err"] for answer in answers)


def test_the_layers_commands_are_listed_as_their_own_parsers_describe_them() -> None:
    parser = command_parser()  # every command loaded
    found: dict[str, dict[str, str]] = {}
    for group, subparsers in (("gradcomp.commands", _subcommands(parser)), ("gradcomp.bench", None)):
        subparsers = subparsers or _subcommands(_subcommands(parser).choices["bench"])
        found[group] = {a.dest: a.help for a in subparsers._choices_actions if a.dest in SUMMARIES[group]}
    assert found == SUMMARIES


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_a_command_without_its_extra_says_which_to_install_in_one_line() -> None:
    experiments, calibrate = "pip install 'gradcomp[experiments]'", "pip install 'gradcomp[calibrate]'"
    says = {
        ("report", "."): f"gradcomp report draws with matplotlib: {experiments}",
        ("sweep", "--dry-run", "quick"): f"gradcomp sweep shows its progress with tqdm: {experiments}",
        ("calibrate", "-o", "profile.json"): f"this command needs scipy, which is not installed: {calibrate}",
    }
    answers, _ = _commands(*says, missing=("matplotlib", "tqdm", "scipy"))
    assert [(a["code"], a["err"]) for a in answers] == [(2, f"gradcomp: error: {line}\n") for line in says.values()]


def test_a_command_of_a_layer_whose_import_fails_is_still_listed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = EntryPoint("fake", "gradcomp_no_such_module:add_command [experiments]", "gradcomp.commands")
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken] if group == "gradcomp.commands" else [])
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr()
    assert "fake" in listed.out and listed.err == ""
    with pytest.raises(SystemExit) as exit_info:
        main(["fake", "--anything"])
    expected = "this command needs gradcomp_no_such_module, which is not installed: pip install 'gradcomp[experiments]'"
    assert exit_info.value.code == 2 and capsys.readouterr().err == f"gradcomp: error: {expected}\n"
