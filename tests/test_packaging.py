"""What installing gradcomp provides: one import name, its version, the shipped sweep configs, and
clear messages naming the extra where an optional dependency is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import gradcomp
import gradcomp.experiments
import gradcomp.hooks
from gradcomp.cli import main
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
