"""Compressors of other packages through the entry-point group ``gradcomp.compressors``: a package
installed beside gradcomp (here a distribution's metadata on the path, as pip leaves it) is known to
the registry, hook specs, ``gradcomp compressors`` and ranks started by gradcomp, with no import by
the user; declarations that cannot work are left out with a warning saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = '''
from gradcomp.compressors import Aggregation, Compressor, CompressorConfig
from gradcomp.compressors.sign import Sign


class MySign(Sign):
    """sign, under another name: a user's compressor."""

    name = "mysign"


class Misnamed(Sign):
    name = "notitsname"


class Undeclared(Compressor):
    """Written before compressors declared a Capabilities record: its aggregation a class attribute."""

    name = "undeclared"
    aggregation = Aggregation.GATHER
    Config = CompressorConfig
'''
ENTRY_POINTS = """[gradcomp.compressors]
mysign = gcplugin:MySign
missing = gcplugin:Nowhere
misnamed = gcplugin:Misnamed
undeclared = gcplugin:Undeclared
sign = gcplugin:MySign
"""
CHECK = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from gradcomp.compressors import REGISTRY, make_compressor
from gradcomp.engine import HookSpec
from gradcomp.launch import spawn
from gradcomp.testing import check_compressor
from gradcomp.cli import main
from tests.plugin_ranks import averaged
main(["compressors"])
compressor = make_compressor("mysign:ef=true")
print(json.dumps({
    "registered": sorted(REGISTRY),
    "spec": str(HookSpec.parse("mysign:ef=true")),
    "inner": type(compressor.inner).__name__,
    "warnings": [str(w.message) for w in caught],
    "ranks": spawn(2, averaged, ("mysign:ef=true",), timeout=120),
    "kit": check_compressor("mysign:ef=true").passed,
}))
"""


def installed(tmp_path: Path) -> dict[str, str]:
    """A package ``gcplugin`` declaring compressors, installed as pip leaves one (its module and its
    ``.dist-info`` on the path); the environment that sees it."""
    (tmp_path / "gcplugin").mkdir()
    (tmp_path / "gcplugin" / "__init__.py").write_text(PLUGIN)
    info = tmp_path / "gcplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gcplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_a_compressor_declared_by_an_entry_point_is_known_everywhere(tmp_path: Path) -> None:
    environment = installed(tmp_path)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    *listing, last = done.stdout.strip().splitlines()
    seen = json.loads(last)
    assert any(line.startswith("mysign") for line in listing), "\n".join(listing)  # gradcomp compressors lists it
    assert "mysign" in seen["registered"] and "notitsname" not in seen["registered"]
    assert seen["spec"].startswith("mysign:") and seen["inner"] == "MySign"
    # ranks started by gradcomp find it without importing the package: the same average on both
    assert seen["ranks"][0] == seen["ranks"][1] and seen["ranks"][0] != 0
    assert "error feedback" in seen["kit"] and "payload only" in seen["kit"]  # the conformance kit passes it
    warned = "\n".join(seen["warnings"])
    assert "missing = 'gcplugin:Nowhere' does not load" in warned
    assert "misnamed = 'gcplugin:Misnamed' names a compressor 'notitsname'" in warned
    assert "sign = 'gcplugin:MySign' names a compressor 'mysign'" in warned
    assert "undeclared = 'gcplugin:Undeclared' declares no capabilities (class attributes such as aggregation" in warned
    assert "undeclared" not in seen["registered"]
