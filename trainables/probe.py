"""What this machine can run: accelerator, versions, Transformer Engine, DeepEP / HybridEP.

Reads package metadata and asks torch about devices; it imports neither megatron-core nor
Transformer Engine (megatron-core 0.19 needs triton just to import), so it answers in a second
on any node, GPU or not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

import torch

from autotune.core.contract import Accelerator

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


def probe() -> dict:
    """This machine's stack as plain data (JSON-able)."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else None
    transformer_engine = _version("transformer-engine", "transformer_engine") \
        if importlib.util.find_spec("transformer_engine") is not None else None
    deep_ep = importlib.util.find_spec("deep_ep") is not None
    return {
        "host": platform.node(),
        "accelerator": accelerator_label(name),
        "device_name": name or platform.processor() or platform.machine(),
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "megatron_core": _version("megatron-core", "megatron_core"),
        "transformer_engine": transformer_engine,
        "deep_ep": deep_ep,
        # HybridEP ships inside DeepEP's hybrid-ep branch as deep_ep.HybridEPBuffer.
        "hybrid_ep": deep_ep and _has_attribute("deep_ep", "HybridEPBuffer"),
    }


def _has_attribute(module: str, attribute: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attribute)
    except Exception:  # noqa: BLE001 - a package that fails to import offers nothing
        return False
