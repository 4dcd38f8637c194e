"""One burst as the tuner sees it: which data folder, run it, and what its records add up to."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from autotune.core.contract import BurstRequest, BurstResult, SteadyWindow
from autotune.core.registry import burst_runner
from autotune.core.steady import steady_state

CACHE_ENV = "AUTOTUNE_CACHE"


def cache_root() -> Path:
    """Where built-in data is built on first use (``$AUTOTUNE_CACHE`` or ``~/.cache/moe-vlm-autotune``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moe-vlm-autotune")


def data_folder(source: str, path: str | None, relative_to: Path) -> Path:
    """The shard folder of a campaign's data section; built-in photos are built on first use."""
    from trainables.data.shards import builtin_photo_shards, list_shards

    if source == "builtin_photos":
        return builtin_photo_shards(cache_root())
    folder = Path(path)
    folder = folder if folder.is_absolute() else relative_to / folder
    list_shards(folder)  # a missing or empty folder is a clear error now, not in a worker later
    return folder


def run_burst(trainable: str, request: BurstRequest) -> BurstResult:
    return burst_runner(trainable)(request)


def summarize(request: BurstRequest, result: BurstResult, min_warmup: int) -> dict[str, Any]:
    """Steady useful tokens/s (and per worker), data-wait share, stage split, as one JSON-able dict.

    Mock-data results are labelled benchmark-only so nothing downstream can rank them.
    """
    records = result.records
    summary: dict[str, Any] = {
        "outcome": result.outcome,
        "error": result.error,
        "data_realism": request.data.realism,
        "benchmark_only": request.data.realism == "mock",
        "steps": len(records),
        "evidence": result.evidence.model_dump(mode="json"),
        "records": [asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in records],
    }
    estimate = steady_state([r.tokens_per_second for r in records], min_warmup=min_warmup) if records else None
    if estimate is not None:
        window = records[estimate.warmup_steps:]
        seconds = sum(r.step_seconds for r in window)
        summary["steady"] = estimate.to_dict() | {
            "metric": "useful_tokens_per_s",
            "useful_tokens_per_s_per_worker": estimate.mean / request.world_size,
            "model_flops_per_s_per_worker": sum(r.model_flops for r in window) / seconds / request.world_size,
            "data_wait_share": sum(r.data_wait_seconds for r in window) / seconds,
            "stage_share": {
                stage: sum(getattr(r, f"{stage}_seconds") for r in window) / seconds
                for stage in ("vision", "projector", "decoder")
            },
            "peak_memory_bytes": max(r.peak_memory_bytes for r in window),
            "gpu_clock": gpu_clock_summary((r.sm_clock_mhz, r.clock_held_by) for r in window),
        }
    if result.contract is not None:
        window = None if estimate is None else SteadyWindow(first_step=estimate.warmup_steps,
                                                            steps=len(records) - estimate.warmup_steps)
        summary["contract"] = result.contract.model_copy(update={"steady_window": window}).to_json()
    return summary


def gpu_clock_summary(steps: Iterable[tuple[float | None, Sequence[str]]]) -> dict[str, Any] | None:
    """Of steps' (SM clock, what held it down): the mean clock and the share of steps whose clock
    power or heat held down (NVML's reasons), with those reasons; ``None`` where no step read a
    clock (the CPU, tables recorded before clocks were)."""
    read = [(clock, held) for clock, held in steps if clock is not None]
    if not read:
        return None
    return {"sm_clock_mhz": sum(clock for clock, _ in read) / len(read),
            "held_share": sum(bool(held) for _, held in read) / len(read),
            "held_by": sorted({reason for _, held in read for reason in held})}
