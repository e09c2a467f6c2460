"""Checkpoints from which a run continues exactly: bitwise the parameters of an uninterrupted run.

One file, written by rank 0 (atomically), loadable with ``torch.load(..., weights_only=True)``:

- ``model``, ``optimizer``, ``scheduler``: their ``state_dict()``s;
- ``hooks``: every rank's hook state (error-feedback residuals and random streams are per rank);
- ``rng``: every rank's torch generator state (and CUDA's, on GPUs);
- ``step``, ``config``, ``world_size``, and ``progress``: training seconds, cumulative wire bytes and
  the run's start time, so that curves against time and bytes continue too.

Data order needs no state: a step's batch is a function of the seed and the step. Rank 0 holds every
rank's hook state while saving (the size of the model's gradients per rank, for error feedback).
"""

from __future__ import annotations

import os
import zipfile
import zlib
from typing import Any

import torch
import torch.distributed as dist

from gradcomp.experiments.training import runinfo
from gradcomp.experiments.training.config import RESUMABLE_CHANGES, TrainConfig

FORMAT = 2
"""2: hook states record their spec and world size."""


def gather(value: Any) -> list[Any] | None:
    """Every rank's ``value`` on rank 0 (None elsewhere), tensors moved to the CPU first."""
    value = to_cpu(value)
    if dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def save(path: str, checkpoint: dict[str, Any]) -> None:
    """Write atomically: an interruption while saving leaves the previous checkpoint intact, and the
    temporary of a save killed before (no live writer) is removed first."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    runinfo.remove_stale_temporaries(directory)  # of a save killed before (SIGKILL): a checkpoint's size
    with runinfo.atomic(path) as file:
        torch.save({"format": FORMAT, **checkpoint}, file)


def load(path: str, config: TrainConfig, world_size: int, device: torch.device) -> dict[str, Any]:
    """Load a checkpoint for ``config`` at ``world_size``; a checkpoint of another run, or a file
    that is not a readable checkpoint (truncated, corrupted, something else), is refused naming it;
    one whose bytes changed on disk (:func:`verify`), naming the damaged member."""
    verify(path)
    try:
        checkpoint: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # torch raises OSError, EOFError, RuntimeError, UnpicklingError, ...
        raise ValueError(f"{path} is not a readable checkpoint ({type(error).__name__}: {error})") from None
    check(path, checkpoint, config, world_size)
    return checkpoint


def verify(path: str) -> None:
    """Refuse a checkpoint whose bytes changed since it was written, in one line naming the damaged
    member: ``torch.load`` checks none of the CRC-32s that its zip file keeps of every member, so 2000
    bytes overwritten inside a tensor loaded silently (and the resumed run ended at an eval accuracy
    of 0.10 instead of 0.55). Costs one more read of the file (``zipfile.ZipFile.testzip``): 12-28 ms
    for the digits MLP's 4.5 MB checkpoint on 2 busy cores, about as long as ``torch.load`` itself."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise ValueError(f"{path} is not a readable checkpoint ({type(error).__name__}: {error})") from None
    if damaged is not None:
        raise ValueError(
            f"{path} is damaged: its member {damaged!r} fails its CRC-32 check (changed on disk since it was "
            "saved); resume from another checkpoint, or start over with --overwrite"
        )


def check(path: str, checkpoint: Any, config: TrainConfig, world_size: int) -> None:
    """Refuse ``checkpoint`` (loaded from ``path``) for ``config`` at ``world_size`` where it cannot
    resume it: another format, world size or run's settings (each changed setting named)."""
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(f"{path}: not a checkpoint of this format ({FORMAT})")
    if checkpoint["world_size"] != world_size:
        raise ValueError(f"{path} was written by {checkpoint['world_size']} ranks; resume it with as many")
    saved, mine = checkpoint["config"], config.to_dict()
    changed = sorted(k for k in mine if k not in RESUMABLE_CHANGES and saved.get(k) != mine[k])
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {mine[k]!r}" for k in changed)
        raise ValueError(f"{path} belongs to a run with other settings ({details})")


def check_before_start(config: TrainConfig) -> None:
    """:func:`load`'s refusals, in the process that starts the ranks, before any starts: a resume that
    cannot work fails as one line, and the run it would have continued stays as it was."""
    path = resume_path(config)
    if path is not None:
        load(path, config, config.ranks, torch.device("cpu"))


def resume_path(config: TrainConfig) -> str | None:
    """The checkpoint ``config`` resumes from: its ``resume`` file, for ``auto`` the run's own if it
    has one, None when it starts afresh."""
    if config.resume is None:
        return None
    if config.resume == "auto":
        return config.checkpoint_path if os.path.isfile(config.checkpoint_path) else None
    if not os.path.isfile(config.resume):
        raise ValueError(f"no checkpoint at {config.resume!r} to resume from")
    return config.resume
