"""Read device values on the host later, without stalling the device now.

``float(t)`` / ``t.item()`` on a CUDA tensor waits until the GPU has finished *everything* queued so far, so
the host stops launching work and the GPU runs dry at the next step boundary. The hot loop instead stages
the few values the host needs (the loss guard's verdict, the stop vote) with :class:`HostCopy`: a
non-blocking copy into pinned host memory plus a CUDA event recorded right after it. Reading the copy
later waits only for that event, which the GPU normally passed long ago, while the next step is already
queued behind it.

On the CPU the device *is* the host: the copy is the tensor itself and is always ready. Reads go through
``numpy()``, not ``item()``, so a host read of a staged value is never mistaken for a device sync
(tests count ``aten._local_scalar_dense`` calls to prove a step makes none).
"""

from __future__ import annotations

from typing import List, Optional

import torch


class HostCopy:
    """A 1-D float64 snapshot of a device tensor, readable on the host once the device got there."""

    def __init__(self, tensor: torch.Tensor):
        t = tensor.detach().reshape(-1).to(torch.float64)
        self._event: Optional["torch.cuda.Event"] = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        elif t.device.type == "cpu":
            self._host = t
        else:  # other accelerators: a plain (blocking) copy is correct, if not free
            self._host = t.cpu()

    def ready(self) -> bool:
        """True when reading now does not wait."""
        return self._event is None or self._event.query()

    def values(self) -> List[float]:
        """The values; waits (only) until the device has produced them."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy().tolist()
