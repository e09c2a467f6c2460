"""What error feedback carries from step to step, per key: the protocol its two variants implement
(:class:`~gradcomp.compressors.feedback.residual.Residuals`, classic;
:class:`~gradcomp.compressors.feedback.ef21.Estimates`, EF21), the context of one step, and the
keyed tensors they and the momentum correction keep."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Key, Payload
from gradcomp.compressors.keys import plain
from gradcomp.workspace import Workspace


@dataclasses.dataclass
class FeedbackContext:
    """One tensor's step inside error feedback: its key, the wrapped compressor's context, and the
    compensated gradient that was compressed (which the payload may alias while it travels)."""

    key: Key
    inner: Any
    compensated: Tensor
    round: int = 0


class Memory(Protocol):
    """A variant's state per key, and the four moments of a step that touch it."""

    def carried(self, key: Key, like: Tensor) -> Tensor:
        """The state the next gradient of ``key`` is compensated with (zeros the first time),
        checked against that gradient (``like``)."""

    def fold(self, share: Tensor, carried: Tensor) -> None:
        """``share`` (the gradient's share, clipped and momentum-corrected) becomes the compensated
        gradient, in place, with :meth:`carried`'s state."""

    def settle(
        self, inner: Compressor, payload: Payload, ctx: FeedbackContext, workspace: Workspace
    ) -> tuple[Tensor, Tensor | None]:
        """The state after this rank's final ``payload`` left, kept only where the step was finite:
        whether it was (a 0-d bool tensor, on the device), and a buffer of the compensated
        gradient's size now free for the key's next step (None: the compensated one stays free)."""

    def handed_on(self, aggregate: Tensor, key: Key) -> Tensor:
        """What the step hands on, given every rank's decompressed ``aggregate`` (in place)."""

    def take(self, key: Key) -> Tensor | None:
        """Forget ``key``; what it had not sent yet (None: nothing is owed)."""

    def tensors(self) -> list[Tensor]:
        """Every tensor kept, in the gradients' units (a loss scale's change rescales them)."""

    def state_dict(self) -> dict[str, Any]:
        """Its part of error feedback's checkpoint: lists of ``{"key": ..., name: tensor}``."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore its part of a checkpoint (the whole of error feedback's state is given)."""


def state_for(states: dict[Key, Tensor], key: Key, like: Tensor, what: str) -> Tensor:
    """``states[key]``: zeros shaped like ``like`` the first time; an error naming ``what`` when the
    key held a tensor of another shape, dtype or device (two tensors under one key)."""
    state = states.get(key)
    if state is None:
        state = states[key] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    elif state.shape != like.shape or state.dtype != like.dtype or state.device != like.device:
        raise ValueError(
            f"error feedback key {key!r} held a {state.dtype} {what} of shape {tuple(state.shape)} on "
            f"{state.device}, now gets {like.dtype} of shape {tuple(like.shape)} on {like.device}: "
            "give every tensor its own key"
        )
    return state


def buffer_for(buffers: dict[Key, Tensor], key: Key, like: Tensor) -> Tensor:
    """A scratch buffer shaped like ``like``, kept per key and reused from step to step (no
    allocation in a steady state); its values are whatever the last step left."""
    buffer = buffers.get(key)
    if buffer is None or buffer.shape != like.shape:
        buffer = buffers[key] = torch.empty_like(like)
    return buffer


def entries(states: dict[Key, Tensor], name: str) -> list[dict[str, Any]]:
    """``states`` as a checkpoint lists them: ``[{"key": key, name: tensor}, ...]`` (keys in their
    plain form, and tensors: loadable with ``weights_only=True``). Copies: the steps update their
    states in place, and a state dict kept while training goes on must stay what it was."""
    return [{"key": plain(key), name: tensor.clone()} for key, tensor in states.items()]


def keyed(listed: Iterable[Mapping[str, Any]], name: str) -> dict[Key, Tensor]:
    """What :func:`entries` listed, by key again (copies: loading one state dict twice gives two
    states that do not share their tensors)."""
    return {entry["key"]: entry[name].clone() for entry in listed}
