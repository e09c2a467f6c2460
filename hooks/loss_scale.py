"""A ``GradScaler``'s loss scale, followed by a hook that keeps state in the units of the gradients it
averages (error feedback's residuals, momentum correction's velocities, EF21's estimates, ``auto``'s
residuals in hand-over). Mixed-precision training multiplies every gradient by the loss scale, and
the scaler grows it or backs it off between steps; state carried from a step at one scale to a step
at another must be multiplied by the new scale over the old, or it is added at the wrong size.

Use: ``hooks.register(model, spec, scaler=scaler)`` (DDP, ``auto``, FSDP2, HSDP). Local SGD and
DiLoCo need none: they average parameters, which a loss scale does not touch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp import host


class LossScale:
    """``scaler``'s loss scale as a hook last saw it; :meth:`change` at the start of each step."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self._last: Tensor | None = None  # the scale the carried state is in

    def change(self) -> Tensor | None:
        """The new scale over the one at the last call, as a 0-d tensor (not read on the host), or
        None where there is nothing to do: the first call, a disabled scaler, or an unchanged scale
        on the CPU. On an accelerator the ratio comes at every call, often 1 (deciding would read
        the scale on the host, a synchronization): multiplying by it is exact either way, since a
        loss scale changes by powers of two."""
        scale = self.scaler._get_scale_async()  # the scale tensor; None while the scaler is disabled
        if scale is None:
            return None
        if self._last is None:
            self._last = scale.detach().clone()
            return None
        if host.reads_are_free(scale.device) and bool(scale == self._last):
            return None
        ratio = scale / self._last
        self._last.copy_(scale)
        return ratio
