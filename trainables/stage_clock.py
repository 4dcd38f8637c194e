"""Per-stage device time (vision encoder, projector) inside a training step, for any model."""

from __future__ import annotations

import time

import torch
from torch import nn


class StageClock:
    """Forward and backward time of the vision encoder and the projector, from module and tensor
    hooks (so it works under DDP and FSDP); CUDA events on a GPU, wall clock on the CPU.

    A stage's backward starts when the gradient reaches its output (backward pre-hook) and ends
    when it reaches the output of its first layer (a tensor hook), which stays correct when the
    stage's own input needs no gradient. The decoder's time is the rest of the step.
    """

    def __init__(self, stages: dict[str, tuple[nn.Module, nn.Module]], cuda: bool) -> None:
        """``stages`` maps a stage's name to its module and the module's first layer."""
        self.cuda = cuda
        self.spans: dict[str, list] = {name: [] for name in stages}
        self._open: dict[str, object] = {}
        for name, (module, first_layer) in stages.items():
            module.register_forward_pre_hook(lambda *_, n=name: self._start(n))
            module.register_forward_hook(lambda *_, n=name: self._stop(n))
            module.register_full_backward_pre_hook(lambda *_, n=name: self._start(n))
            first_layer.register_forward_hook(lambda _m, _i, out, n=name: self._stop_on_gradient(n, out))

    def _stop_on_gradient(self, name: str, output) -> None:
        if isinstance(output, tuple):  # megatron-core linears return (output, bias)
            output = output[0]
        if output.requires_grad:
            output.register_hook(lambda grad: self._stop(name))

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, name: str) -> None:
        self._open[name] = self._now()

    def _stop(self, name: str) -> None:
        start = self._open.pop(name, None)
        if start is not None:
            self.spans[name].append((start, self._now()))

    def collect(self) -> dict[str, float]:
        """Seconds per stage since the last call (synchronises the device on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        totals = {}
        for name, spans in self.spans.items():
            if self.cuda:
                totals[name] = sum(a.elapsed_time(b) for a, b in spans) / 1000.0
            else:
                totals[name] = sum(b - a for a, b in spans)
            spans.clear()
        return totals
