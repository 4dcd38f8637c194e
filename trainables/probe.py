"""What this machine can run: accelerator, versions, Transformer Engine, DeepEP / HybridEP.

Reads package metadata and asks torch about devices. It never imports megatron-core (0.19 needs
triton just to import); it imports Transformer Engine's PyTorch module only where TE is installed,
because an install whose core library cannot load (a missing cuDNN, a CUDA mismatch) reads as
installed in the metadata yet fails the first burst: such a TE counts as absent, with the reason.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path

import torch

from autotune.core.contract import Accelerator

CPU_INFO = Path("/proc/cpuinfo")
IMEX_CHANNELS = Path("/dev/nvidia-caps-imex-channels")
"""Where the driver exposes the IMEX channels a process may use: on GB200, a GPU maps another tray's
memory over NVLink only through one (a Kubernetes ComputeDomain claim or the node's IMEX service)."""

# Device names as torch reports them ("NVIDIA H200", "NVIDIA GB200") → our accelerator labels.
_ACCELERATORS: tuple[tuple[str, Accelerator], ...] = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"),
                                                      ("H100", "h100"))


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def accelerator_label(device_name: str | None) -> Accelerator | None:
    """Our label for a CUDA device name; ``None`` for a device we have no label for."""
    if device_name is None:
        return "cpu"
    return next((label for key, label in _ACCELERATORS if key in device_name.upper()), None)


@functools.cache
def transformer_engine_status() -> tuple[str | None, str | None]:
    """``(version, None)`` when Transformer Engine's PyTorch module loads, ``(None, None)`` when TE
    is not installed, ``(None, reason)`` when it is installed but cannot load: the reason is one
    line naming what is missing (``ImportError: libcudnn.so.9: cannot open shared object file``)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None, None
    version = _version("transformer-engine", "transformer_engine") or "unknown"
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - any failure to load is the same fact: TE unusable here
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        return None, f"Transformer Engine {version} is installed but cannot load: {type(exc).__name__}: {first_line}"
    return version, None


def probe() -> dict:
    """This machine's stack as plain data (JSON-able)."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else None
    transformer_engine, transformer_engine_error = transformer_engine_status()
    deep_ep = importlib.util.find_spec("deep_ep") is not None
    return {
        "host": platform.node(),
        # Which machine, where every lent machine is called "vm": the same config ran 42 % faster
        # over 120 steps on one H100 machine than in its 16-step row on another (host-bound at MBS 1).
        "host_cpu": host_cpu(),
        "device_uuid": str(torch.cuda.get_device_properties(0).uuid) if cuda else None,
        "accelerator": accelerator_label(name),
        "device_name": name or platform.processor() or platform.machine(),
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "megatron_core": _version("megatron-core", "megatron_core"),
        "transformer_engine": transformer_engine,
        "transformer_engine_error": transformer_engine_error,
        "deep_ep": deep_ep,
        # HybridEP ships inside DeepEP's hybrid-ep branch as deep_ep.HybridEPBuffer.
        "hybrid_ep": deep_ep and _has_attribute("deep_ep", "HybridEPBuffer"),
        "imex_channels": _imex_channels(),
    }


def host_cpu() -> str:
    """The host's CPU model and how many cores this process may use: a host-bound burst's speed
    follows the host, which the device's name does not tell."""
    try:
        model = next((line.split(":", 1)[1].strip() for line in CPU_INFO.read_text().splitlines()
                      if line.startswith("model name")), None)
    except OSError:  # not Linux
        model = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model or platform.processor() or platform.machine()}, {cores} cores"


def _imex_channels() -> int:
    try:
        return sum(1 for entry in IMEX_CHANNELS.iterdir() if entry.name.startswith("channel"))
    except OSError:  # no such folder: no channel
        return 0


def _has_attribute(module: str, attribute: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attribute)
    except Exception:  # noqa: BLE001 - a package that fails to import offers nothing
        return False
