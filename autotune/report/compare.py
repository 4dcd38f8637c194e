"""Two campaigns side by side — FSDP-first against 3D parallelism, say — by useful tokens per
second per device and the workload's shape, never by raw step time: a 3D layout's step carries a
different global batch over a different number of devices, so its step time compares nothing.

Runs compare only when they trained the same workload (model, sequence length, images, data
realism); otherwise the comparison says why not instead of a ratio.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Any

from autotune.core.contract import Shapes
from autotune.core.knobs import Config
from autotune.report.analysis import RunReport


@dataclass(frozen=True)
class Workload:
    """What must match for two runs' rates to compare."""

    model: str | None
    seq_length: int | None
    images: Any
    """The model's image policy (pixel bounds, images per sample)."""
    data_realism: str | None
    precision: str | None
    objective: str

    def differences(self, other: "Workload") -> list[str]:
        return [f"{f.name}: {mine!r} against {theirs!r}"
                for f, mine, theirs in zip(fields(self), astuple(self), astuple(other)) if mine != theirs]


@dataclass(frozen=True)
class Side:
    name: str
    path: str
    layout: str
    """``FSDP (…)`` or ``3D TP t · PP p · CP c · EP e …``."""
    devices_per_trial: int
    objective: float | None
    ci_low: float | None
    ci_high: float | None
    stage: str
    """Where the figure comes from: the verdict's winner, else the best screened trial."""
    workload: Workload
    shapes: Shapes | None
    nodes: frozenset[str] | None = None
    """The nodes the figure's run measured on, where its contract says (:attr:`Contract.measured_on`)."""


@dataclass(frozen=True)
class Comparison:
    a: Side
    b: Side
    comparable: bool
    differences: list[str]
    ratio: float | None
    """B's per-device objective over A's."""
    verdict: str


def layout(config: Config) -> str:
    if config.use_megatron_fsdp or config.use_torch_fsdp2:
        kind = "Megatron-FSDP" if config.use_megatron_fsdp else "torch FSDP2"
        sharding = f" {config.data_parallel_sharding_strategy}" if config.data_parallel_sharding_strategy else ""
        return f"FSDP ({kind}{sharding}, EP {config.expert_model_parallel_size})"
    parts = [f"TP {config.tensor_model_parallel_size}", f"PP {config.pipeline_model_parallel_size}",
             f"CP {config.context_parallel_size}", f"EP {config.expert_model_parallel_size}"]
    if config.expert_tensor_parallel_size:
        parts.append(f"ETP {config.expert_tensor_parallel_size}")
    return "3D " + " · ".join(parts)


def side(report: RunReport) -> Side:
    best = report.winner or max((e for e in report.launched("screen") if e.objective is not None),
                                key=lambda e: e.objective, default=None)
    contract = (best.contract if best is not None else None) or report.contract
    model = (contract.model if contract is not None else None) or {}
    estimate = best.estimate if best is not None else None
    return Side(
        name=report.campaign, path=str(report.path),
        layout=layout(best.config) if best else "nothing ran",
        devices_per_trial=report.world_size,
        objective=best.objective if best else None,
        ci_low=estimate.ci_low if estimate else None, ci_high=estimate.ci_high if estimate else None,
        stage="winner" if report.winner else "best screened (no verdict)",
        workload=Workload(
            model=model.get("name"), seq_length=model.get("seq_length"), images=model.get("images"),
            data_realism=contract.data.realism if contract is not None and contract.data is not None else None,
            precision=contract.precision if contract is not None else None, objective=report.objective),
        shapes=contract.shapes if contract is not None else None,
        nodes=frozenset(worker.node_id for worker in contract.measured_on)
        if contract is not None and contract.measured_on else None,
    )


def compare(a: RunReport, b: RunReport) -> Comparison:
    left, right = side(a), side(b)
    differences = left.workload.differences(right.workload)
    if left.objective is None or right.objective is None:
        missing = a.campaign if left.objective is None else b.campaign
        return Comparison(left, right, False, differences, None, f"{missing} has no finished trial to compare")
    if any(side.workload.data_realism != "real" for side in (left, right)):
        differences.append("mock data: benchmark-only, never a throughput comparison")
    if differences:
        return Comparison(left, right, False, differences, None,
                          "not comparable: the runs trained different workloads (" + "; ".join(differences) + ")")
    ratio = right.objective / left.objective
    overlap = None not in (left.ci_low, left.ci_high, right.ci_low, right.ci_high) and \
        right.ci_low <= left.ci_high and left.ci_low <= right.ci_high
    if overlap:
        verdict = f"tied: {b.campaign} at {ratio:.3f}x {a.campaign}, within each other's intervals"
    else:
        faster, slower = (b.campaign, a.campaign) if ratio > 1 else (a.campaign, b.campaign)
        verdict = f"{faster} is {max(ratio, 1 / ratio):.3f}x {slower} per device, beyond both intervals"
    if None not in (left.nodes, right.nodes) and left.nodes != right.nodes:
        verdict += ("; the two ran on different nodes, so the ratio holds the machines' differences too (long runs "
                    "of one config differed 13–47 % between H100s)")
    return Comparison(left, right, True, [], ratio, verdict)
