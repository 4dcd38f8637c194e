"""Promotion: which screened configs are re-run long, and what the long runs let us conclude.

A promoted config wins only if its knobs demonstrably took effect (the trainable's runtime
evidence) and it beats the others beyond their intervals; configs whose intervals overlap the
winner's are reported as tied with it, never ranked by noise. Mock-data runs never win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.core.knobs import Config, complete_config


def promotion_candidates(entries: list[dict[str, Any]], top_k: int, space: str,
                         margin: float) -> list[tuple[Config, str]]:
    """The ``top_k`` best distinct configs screened in ``space`` (ok outcome), best first, not yet
    promoted, leaving out those the best screen beat beyond the intervals by ``margin`` (the
    screening scheduler's pruning rule, applied once all screens are in: a long run of a config
    its screen already ruled out would only confirm it)."""
    entries = [e for e in entries if e["space"] == space]
    promoted = {complete_config(e["config"]) for e in entries if e["launched"] and e["stage"] == "promote"}
    screened = sorted(
        (e for e in entries if e["launched"] and e["stage"] == "screen" and e["outcome"] == "ok"
         and e.get("objective") is not None),
        key=lambda e: -e["objective"],
    )
    chosen: list[tuple[Config, str]] = []
    seen: set[Config] = set()
    for entry in screened:
        config = complete_config(entry["config"])
        if config in seen:
            continue
        seen.add(config)
        if len(seen) > top_k:
            break
        if entry["estimate"]["ci_high"] < screened[0]["estimate"]["ci_low"] * (1 - margin):
            continue
        if config not in promoted:
            chosen.append((config, f"screen:{entry['trial_id']}"))
    return chosen


def projected_headroom(promoted: list[dict[str, Any]], reachable_tflops_per_gpu: float) -> float | None:
    """What the next space could gain over the best promoted config of this one, in model TFLOP/s
    per GPU (``reachable / best - 1``); ``None`` when nothing was promoted with a FLOP rate."""
    rates = [e["model_tflops_per_s_per_gpu"] for e in promoted
             if e["outcome"] == "ok" and e.get("model_tflops_per_s_per_gpu")]
    return reachable_tflops_per_gpu / max(rates) - 1 if rates else None


def failed_checks(entry: dict[str, Any]) -> list[str]:
    return sorted(knob for knob, ok in (entry.get("evidence") or {}).get("checks", {}).items() if not ok)


@dataclass
class Verdict:
    winner: dict[str, Any] | None
    tied: list[dict[str, Any]] = field(default_factory=list)
    """Promoted configs whose interval overlaps the winner's."""
    disqualified: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    summary: str = ""


def decide(promoted: list[dict[str, Any]]) -> Verdict:
    """The winner among promoted runs, the configs tied with it, and those ruled out (and why)."""
    eligible, disqualified = [], []
    for entry in promoted:
        if entry["outcome"] != "ok" or not entry.get("estimate"):
            disqualified.append((entry, f"promotion run ended {entry['outcome']}: {entry.get('reason')}"))
        elif entry.get("benchmark_only"):
            disqualified.append((entry, "mock (image-free) data: benchmark-only, never a throughput result"))
        elif failed := failed_checks(entry):
            disqualified.append((entry, f"runtime evidence contradicts the config for {', '.join(failed)}"))
        else:
            eligible.append(entry)
    if not eligible:
        return Verdict(None, [], disqualified, "no promoted config is eligible to win")
    eligible.sort(key=lambda e: -e["objective"])
    winner, others = eligible[0], eligible[1:]
    low = winner["estimate"]["ci_low"]
    tied = [e for e in others if e["estimate"]["ci_high"] >= low]
    if not others:
        summary = "the only eligible promoted config"
    elif tied:
        summary = f"tied with {len(tied)} other promoted config(s): their intervals overlap the winner's"
    else:
        runner_up = others[0]
        gain = winner["objective"] / runner_up["objective"] - 1 if runner_up["objective"] else float("inf")
        summary = f"beats every other promoted config beyond their intervals (+{100 * gain:.1f}% over the next)"
    return Verdict(winner, tied, disqualified, summary)


def leaderboard(entries: list[dict[str, Any]], verdict: Verdict) -> dict[str, Any]:
    """The promoted runs best first, with their screening estimate beside them, and the verdict."""
    screened = {}
    for entry in entries:
        if entry["launched"] and entry["stage"] == "screen" and entry.get("objective") is not None:
            key = complete_config(entry["config"])
            screened[key] = max(screened.get(key, 0.0), entry["objective"])
    rows = []
    promoted = sorted((e for e in entries if e["launched"] and e["stage"] == "promote"),
                      key=lambda e: -(e.get("objective") or 0.0))
    tied_ids = {e["trial_id"] for e in verdict.tied}
    ruled_out = {e["trial_id"]: why for e, why in verdict.disqualified}
    for rank, entry in enumerate(promoted, 1):
        estimate = entry.get("estimate") or {}
        rows.append({
            "rank": rank,
            "trial_id": entry["trial_id"],
            "config": entry["config"],
            "outcome": entry["outcome"],
            "objective": entry.get("objective"),
            "ci_low": estimate.get("ci_low"),
            "ci_high": estimate.get("ci_high"),
            "space": entry["space"],
            "steps": entry.get("steps"),
            "steady_steps": estimate.get("window"),
            "screen_objective": screened.get(complete_config(entry["config"])),
            "winner": verdict.winner is not None and entry["trial_id"] == verdict.winner["trial_id"],
            "tied_with_winner": entry["trial_id"] in tied_ids,
            "ruled_out": ruled_out.get(entry["trial_id"]),
        })
    return {"verdict": verdict.summary, "rows": rows}
