"""The measurement contract the measuring trainables write with every burst: what its figures were
measured on (versions, hardware, model, data, precision, shapes, timing method, FLOPs convention,
config), so that only figures measured alike are compared.

The parts every trainable fills the same way are filled here; a trainable passes what differs. A
field a trainable has no value for stays unset, so it is absent from the contract's JSON rather
than ``null``: a native contract has no layer spec, a megatron one no CPU threads.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import tomllib
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from autotune.core.contract import BurstRequest, Contract, DataProvenance, Hardware, Shapes
from trainables.data import tokenizer
from trainables.flops import CONVENTION


def measurement_contract(
    trainable: str,
    request: BurstRequest,
    device: torch.device,
    *,
    world_size: int,
    shapes: Shapes,
    precision: str,
    timing: str,
    versions: Mapping[str, str | None] = MappingProxyType({}),
    cpu_threads_per_rank: int | None = None,
    counted_memory_bytes: int | None = None,
    layer_spec: str | None = None,
    kernels: Mapping[str, bool] | None = None,
) -> Contract:
    """The contract of a burst of ``trainable`` run for ``request`` on ``device`` (this rank's).

    Args:
        world_size: the ranks the burst ran on.
        shapes: the workload's shape as the trainable ran it.
        precision, timing: how the trainable computes and how it times a step, in words.
        versions: versions beyond Python's and torch's (megatron-core, Transformer Engine, CUDA).
        cpu_threads_per_rank: intra-op threads of each rank, where the CPU computes.
        counted_memory_bytes: each rank's counted device memory, where peaks count tensors.
        layer_spec: megatron-core's layer specs, for a trainable built from them.
        kernels: the fused kernels it chose that no knob owns.
    """
    return Contract(
        trainable=trainable,
        versions={"python": platform.python_version(), "torch": torch.__version__, "autotune": code_version(), **versions},
        hardware=Hardware(device=_device_name(device), accelerator="cuda" if device.type == "cuda" else "cpu",
                          world_size=world_size, **_given(cpu_threads_per_rank=cpu_threads_per_rank,
                                                          counted_memory_bytes=counted_memory_bytes)),
        model=request.model.model_dump(),
        data=DataProvenance(folder=request.data.folder, realism=request.data.realism, tokenizer=tokenizer.NAME),
        precision=precision,
        shapes=shapes,
        timing=timing,
        flops_convention=CONVENTION,
        config=request.config,
        **_given(layer_spec=layer_spec, kernels=dict(kernels) if kernels is not None else None),
    )


CHECKOUT = Path(__file__).resolve().parent.parent
CODE_FOLDERS = ("autotune", "trainables")


@functools.cache
def code_version(checkout: Path = CHECKOUT) -> str:
    """The tuner's version and a hash of its Python sources and the trainables'
    (``0.1.0+src.3f9a1c2e4b5d``): a table is recorded over device sessions whose code changed in
    between, on machines that get a copy of the tree without its git history, so the contract says
    which code measured each row. The same sources give the same hash wherever they are."""
    digest = hashlib.sha256()
    for path in sorted(file for folder in CODE_FOLDERS for file in (checkout / folder).rglob("*.py")):
        digest.update(path.relative_to(checkout).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    # From the checkout, not the installed metadata: the GPU machine runs the tree off its path, uninstalled.
    version = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["version"]
    return f"{version}+src.{digest.hexdigest()[:12]}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that have a value: passing ``None`` would set them (and write ``null``)."""
    return {name: value for name, value in fields.items() if value is not None}
