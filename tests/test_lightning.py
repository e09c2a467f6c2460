"""PyTorch Lightning with gradcomp (``gradcomp.hooks.lightning``), 2 CPU processes started as Lightning
starts them (its own launcher re-runs the job's command for the second rank, gloo): a DDP hook, ``auto``,
gradcomp's reduce-scatter under FSDP2 (ModelParallelStrategy) and DiLoCo (the Synchronize callback)
each average, log their statistics through Lightning's logger and end with identical ranks; a run
resumed from the checkpoint of its first epoch's end ends bitwise where the run straight through does
(every rank's residuals in the checkpoint). Lightning is a declared extra of the development set-up
(``gradcomp[lightning]``): without it these tests fail."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

from tests.jobs import alike, rank_parameters, run_job

SPEC = "topk:ratio=0.1,ef=true"
RUNS = {  # every test's run, in one job: starting Lightning's two processes costs more than the runs
    "hook": f"{SPEC}@resumed",
    "diloco": "diloco:every=3@resumed",
    "auto": "auto:candidates=topk:ratio=0.1,ef=true,measure_at=2",
    "fsdp": "fsdp:topk:ratio=0.1,ef=true@resumed",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """``tests/lightning_job.py`` as a user runs a script (Lightning starts the second rank itself), 6
    steps a run: per test, the run straight through and, where asked, the one resumed from its first
    epoch's checkpoint."""
    out = tmp_path_factory.mktemp("lightning")
    run_job([sys.executable, "-m", "tests.lightning_job", str(out), "6", *RUNS.values()], out)
    return {name: (out / str(i) / "straight", out / str(i) / "resumed") for i, name in enumerate(RUNS)}


@pytest.mark.timeout(600)
def test_lightning_trains_with_a_gradcomp_hook_logs_it_and_resumes_bitwise(runs: dict[str, tuple[Path, Path]]) -> None:
    straight, resumed = runs["hook"]
    rows = list(csv.DictReader((straight / "logs" / "version_0" / "metrics.csv").open()))
    logged = [row for row in rows if row.get("hook/wire_mb")]
    assert [int(row["step"]) for row in logged] == list(range(6)), "the hook's statistics at every step"
    assert all(float(row["hook/compression_ratio"]) > 3 for row in logged)
    assert alike(rank_parameters(straight, 0), rank_parameters(straight, 1))
    hooks_saved = torch.load(straight / "epoch1.ckpt", weights_only=True)["callbacks"]["HookStatistics"]["ranks"]
    assert len(hooks_saved) == 2 and all(saved["compressor"] for saved in hooks_saved), "every rank's residuals"
    assert alike(rank_parameters(resumed, 0), rank_parameters(straight, 0))


def logged(out: Path, metric: str) -> list[dict[str, str]]:
    rows = csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open())
    return [row for row in rows if row.get(metric)]


@pytest.mark.timeout(600)
def test_diloco_through_lightning_synchronizes_logs_and_resumes_bitwise(runs: dict[str, tuple[Path, Path]]) -> None:
    """Every 3 steps the replicas (each trained on its rank's own batches, nothing averaged per step)
    synchronize: they end identical, the synchronizing steps are logged, a resumed run is bitwise."""
    straight, resumed = runs["diloco"]
    assert [int(row["step"]) for row in logged(straight, "sync/wire_mb")] == [2, 5], "the synchronizing steps"
    assert alike(rank_parameters(straight, 0), rank_parameters(straight, 1))
    assert alike(rank_parameters(resumed, 0), rank_parameters(straight, 0))


@pytest.mark.timeout(300)
def test_auto_through_lightning_chooses_and_logs_every_step(runs: dict[str, tuple[Path, Path]]) -> None:
    out, _ = runs["auto"]
    assert [int(row["step"]) for row in logged(out, "hook/wire_mb")] == list(range(6))
    assert alike(rank_parameters(out, 0), rank_parameters(out, 1))


@pytest.mark.timeout(600)
def test_fsdp2_through_lightnings_model_parallel_strategy(runs: dict[str, tuple[Path, Path]]) -> None:
    """FSDP2 applied in configure_model, gradcomp's reduce-scatter installed on it by the strategy:
    it logs every step, trains, and resumes bitwise from the first epoch's checkpoint (every rank's
    residuals in it). gradcomp's reduce-scatter against FSDP2's own: tests/test_fsdp.py."""
    compressed, resumed = runs["fsdp"]
    assert [int(row["step"]) for row in logged(compressed, "hook/wire_mb")] == list(range(6))
    assert all(float(row["hook/compression_ratio"]) > 3 for row in logged(compressed, "hook/wire_mb"))
    trained = rank_parameters(compressed, 0)
    assert alike(trained, rank_parameters(compressed, 1))
    torch.manual_seed(0)
    from tests.toy_ddp import toy_model

    assert not alike(trained, [p.detach() for p in toy_model().parameters()])
    assert alike(rank_parameters(resumed, 0), trained)
