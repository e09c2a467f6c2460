"""docs/your-compressor.md, end to end: the example package (examples/tophalf) is the one the page
shows, and once installed (its .dist-info on the path, as pip leaves it) its compressor is listed,
passes the conformance kit and trains in a sweep whose report compares it with torch's all-reduce."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tophalf"
PAGE = ROOT / "docs" / "your-compressor.md"
LIST_AND_CHECK = """
from gradcomp.cli import main
from gradcomp.testing import check_compressor
main(["compressors"])
print(check_compressor("tophalf:ratio=0.01,ef=true").passed)
"""
# (across ranks the kit is tested in tests/test_conformance.py, and the docs test runs the page's own
# ranks=2 snippet: here, the installed entry point is what is new)


def test_the_page_shows_the_example_as_it_is() -> None:
    page = PAGE.read_text()
    for name in ("tophalf.py", "sweep.toml"):
        assert (EXAMPLE / name).read_text() in page, f"docs/your-compressor.md no longer shows examples/tophalf/{name}"
    assert '[project.entry-points."gradcomp.compressors"]\ntophalf = "tophalf:TopHalf"' in page
    assert 'tophalf = "tophalf:TopHalf"' in (EXAMPLE / "pyproject.toml").read_text()


def installed(site: Path) -> dict[str, str]:
    """examples/tophalf as `pip install` leaves it: the module and its .dist-info with the entry point."""
    info = site / "gradcomp_tophalf-0.1.0.dist-info"
    info.mkdir(parents=True)
    (site / "tophalf.py").write_text((EXAMPLE / "tophalf.py").read_text())
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gradcomp-tophalf\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[gradcomp.compressors]\ntophalf = tophalf:TopHalf\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def run(arguments: list[str], cwd: Path, environment: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, *arguments], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    assert done.returncode == 0, f"{arguments}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_example_installs_checks_and_trains_against_torch(tmp_path: Path) -> None:
    environment = installed(tmp_path / "site")
    listing, passed = run(["-c", LIST_AND_CHECK], tmp_path, environment).rsplit("\n", 2)[:2]
    assert "tophalf" in listing
    assert "'error feedback'" in passed
    # the page's sweep, cut to one seed of a few steps on loopback, with the baseline and tophalf
    config = (EXAMPLE / "sweep.toml").read_text()
    config = config.replace("steps = 200", "steps = 6").replace("eval_every = 20", "eval_every = 3")
    config = config.replace('networks = ["loopback", "1gbit"]', 'networks = ["loopback"]')
    config = config.replace("seeds = [0, 1, 2]", "seeds = [0]")
    for hook in ('    "torch:bf16",', '    "topk:ratio=0.01,ef=true",'):
        config = "\n".join(line for line in config.splitlines() if not line.startswith(hook))
    (tmp_path / "sweep.toml").write_text(config)
    run(["-m", "gradcomp.cli", "sweep", "sweep.toml", "--out", "runs", "--no-report"], tmp_path, environment)
    run(["-m", "gradcomp.cli", "report", "runs", "--markdown", "report.md"], tmp_path, environment)
    report = (tmp_path / "report.md").read_text()
    assert "tophalf:ratio=0.01,ef=true" in report and "torch:allreduce" in report, report[:3000]
