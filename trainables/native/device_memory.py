"""A device memory for CPU runs, counted in tensors rather than read from the allocator.

On a GPU a config runs out of memory when its tensors outgrow the device. A CPU rank has no such
wall: its resident set also holds the allocator's freed blocks, which creep with the heap's history
(at MBS 4 with full recompute a rank's growth went 303 -> 338 -> 369 MiB over 3 / 12 / 40 steps), so
a cap on it passes a config in an 8-step screen and fails it in its 50-step promotion. This counts
what a device would hold instead: the rank's parameters, and for each one it trains, its gradient
and AdamW's two moments (the static part, fixed once the model is built and sharded), plus the
activations each micro-batch holds saved for backward when its forward ends, counted by storage (a
parameter saved for backward is not counted twice). Over the budget, the step raises
``torch.OutOfMemoryError`` there, before its backward, as an allocation would on a GPU. The same config meets the same
wall at any step count, on any machine; only a micro-batch with more image tokens saves more.

Not counted: temporaries that autograd does not save, the transient activations a recomputed
region saves again during backward, communication buffers and DDP's gradient buckets. It is a
model of a device's memory, and the contract says so (``hardware.counted_memory_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

ADAMW_STATES_PER_PARAMETER = 2
"""AdamW keeps ``exp_avg`` and ``exp_avg_sq`` for each trained parameter, each its size."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class CountedDeviceMemory:
    """One rank's counted bytes against its budget: the static part, and what the micro-batch in
    flight holds saved for backward once its forward is done (its peak: backward frees it)."""

    def __init__(self, budget_bytes: int, parameters: Iterable[nn.Parameter]) -> None:
        self.budget_bytes = budget_bytes
        parameters = list(parameters)
        self.static_bytes = sum(
            _local(p).nbytes * (1 + (1 + ADAMW_STATES_PER_PARAMETER) * p.requires_grad) for p in parameters
        )
        self._parameter_storages = {_storage_key(_local(p)) for p in parameters}
        self.peak_bytes = self.static_bytes
        self._check(0)

    @contextmanager
    def micro_batch(self) -> Iterator[Callable[[], None]]:
        """Collect the storages this micro-batch's forward saves for backward; the caller calls
        what this yields once the forward is done, which counts them (and raises if over)."""
        saved: dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = _storage_key(tensor)
            if key not in self._parameter_storages:
                saved.setdefault(key, tensor)
            return tensor

        def forward_done() -> None:
            # Counted now, not as saved: FSDP2 frees a layer's gathered weights after its
            # forward, though autograd saved them.
            saved_bytes = sum(_storage_bytes(tensor) for tensor in saved.values())
            self.peak_bytes = max(self.peak_bytes, self.static_bytes + saved_bytes)
            self._check(saved_bytes)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield forward_done
        finally:
            saved.clear()

    def _check(self, saved_bytes: int) -> None:
        held = self.static_bytes + saved_bytes
        if held > self.budget_bytes:
            raise torch.OutOfMemoryError(
                f"counted device memory: {held / 2**20:.1f} MiB ({self.static_bytes / 2**20:.1f} MiB of parameters, "
                f"gradients and AdamW moments, {saved_bytes / 2**20:.1f} MiB saved for backward) is over the "
                f"rank's {self.budget_bytes / 2**20:.1f} MiB"
            )


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_key(tensor: torch.Tensor) -> int:
    """The tensor's storage, by address; the tensor itself where Python cannot read its storage's
    (the expert all-to-all's outputs, for one)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return id(tensor)


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except RuntimeError:
        return tensor.nbytes
