"""Two campaigns side by side — FSDP-first against 3D parallelism, say — by useful tokens per
second per device and the workload's shape, never by raw step time: a 3D layout's step carries a
different global batch over a different number of devices, so its step time compares nothing.

Runs compare only when they trained the same workload (model, sequence length, images, data
realism); otherwise the comparison says why not instead of a ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.core.knobs import complete_config
from autotune.report.analysis import RunReport

WORKLOAD_KEYS = ("model", "seq_length", "images", "data_realism", "precision", "objective")
"""What must match for two runs' rates to compare."""


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
    workload: dict[str, Any]
    shapes: dict[str, Any]


@dataclass(frozen=True)
class Comparison:
    a: Side
    b: Side
    comparable: bool
    differences: list[str]
    ratio: float | None
    """B's per-device objective over A's."""
    verdict: str


def layout(config_plain: dict[str, Any]) -> str:
    config = complete_config(config_plain)
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
    best = report.winner or max((e for e in report.launched("screen") if e.get("objective") is not None),
                                key=lambda e: e["objective"], default=None)
    contract = (best or {}).get("contract") or report.contract or {}
    model = contract.get("model") or {}
    estimate = (best or {}).get("estimate") or {}
    return Side(
        name=report.campaign, path=str(report.path),
        layout=layout(best["config"]) if best else "nothing ran",
        devices_per_trial=report.world_size,
        objective=(best or {}).get("objective"), ci_low=estimate.get("ci_low"), ci_high=estimate.get("ci_high"),
        stage="winner" if report.winner else "best screened (no verdict)",
        workload={"model": model.get("name"), "seq_length": model.get("seq_length"), "images": model.get("images"),
                  "data_realism": (contract.get("data") or {}).get("realism"),
                  "precision": contract.get("precision"), "objective": report.objective},
        shapes=contract.get("shapes") or {},
    )


def compare(a: RunReport, b: RunReport) -> Comparison:
    left, right = side(a), side(b)
    differences = [f"{key}: {left.workload[key]!r} against {right.workload[key]!r}"
                   for key in WORKLOAD_KEYS if left.workload[key] != right.workload[key]]
    if left.objective is None or right.objective is None:
        missing = a.campaign if left.objective is None else b.campaign
        return Comparison(left, right, False, differences, None, f"{missing} has no finished trial to compare")
    if any(realism not in ("real", "realistic") for realism in (left.workload["data_realism"],
                                                               right.workload["data_realism"])):
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
    return Comparison(left, right, True, [], ratio, verdict)
