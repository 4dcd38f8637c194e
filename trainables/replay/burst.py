"""Serve a recorded burst through the burst contract, in no time.

A replayed burst reports the recorded warm-up steps as they were, then the recorded steady steps
in a shuffled order (where warm-up ends is found on the recorded throughput, as the tuner finds
it), seeded by the request's seed, the config and the number of steps asked, so a screen and a
promotion of one config draw differently and a run replays identically. Outcomes are
the recorded ones: an OOM after k steps replays k steps and ends ``oom``. Time is virtual: every
report carries the seconds the recorded burst had spent by then, start-up included, and the tuner
charges those instead of its clock, so a campaign replays in seconds what took device-hours. The
start-up is the warm one (ranks forked from a running zygote, as campaigns start them) where the
table recorded it and the request asks for it, else the cold one; the contract's ``rank_start``
says which. A replay after a healthy one in the same process (a Tune trial process runs its slot's
trials one after another, as the node's zygote keeps a slot's ranks) charges what a burst in kept
ranks paid, start-up and first step, where every row of the table recorded it, unless the request
asks for new rank processes (a promotion).
A replay measured nothing: its contract says so (``trainable: replay``) and carries the recorded
burst's contract as the table holds it; it observed no knob, so its evidence is empty.

Per-stage times and FLOPs are not in a table: they replay as zero (a replay measures the tuner,
never the model).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from autotune.core.contract import BurstRequest, BurstResult, Contract, Evidence, Reporter, StepRecord, StepReport
from autotune.core.steady import steady_state
from autotune.core.tables import ChargedStart, RecordedBurst, RecordedTable, load_table
from trainables.launch import KEPT_OUTCOMES

GIB = 2**30
RECORDED_WARMUP_MIN = 1
"""The fewest recorded steps taken as warm-up (the first step builds graphs and caches)."""


_healthy_before: dict[str, bool] = {}
"""Per table, whether this process's last replay ended so that its ranks would be kept."""


@functools.lru_cache(maxsize=8)
def _table(path: str, modified: float) -> RecordedTable:
    return load_table(Path(path))


def table_for(request: BurstRequest) -> RecordedTable:
    if request.replay_table is None:
        raise ValueError("a replay burst needs the request's replay_table")
    path = Path(request.replay_table)
    return _table(str(path), path.stat().st_mtime)


def warmup_steps(row: RecordedBurst) -> int:
    """Recorded steps before the steady window (all of them when no window is found)."""
    estimate = steady_state(row.throughput, min_warmup=RECORDED_WARMUP_MIN)
    return len(row.step_seconds) if estimate is None else estimate.warmup_steps


def replayed_step_seconds(row: RecordedBurst, steps: int, seed: int, key: str) -> list[float]:
    """The step times a replay of ``steps`` steps reports (fewer when the recorded burst ended early).

    Steady steps are drawn without replacement: each recorded step is reported once before any is
    reported again, in a fresh shuffle each pass. Drawn with replacement, a screen shorter than the
    recording repeated steps that were measured once (an 8-step screen could report one value three
    or four times, whose steady interval then had no width at all). A replay longer than the
    recording has no more steps to show than were measured: it shows each of them once a pass, so
    its steady steps keep the recorded distribution.
    """
    recorded = row.step_seconds
    if row.outcome != "ok":
        return recorded[:steps]
    warmup = warmup_steps(row)
    steady = recorded[warmup:] or recorded
    draw = random.Random(f"{seed}:{key}:{steps}")
    drawn: list[float] = []
    while warmup + len(drawn) < steps:
        drawn += draw.sample(steady, len(steady))
    return (recorded[:warmup] + drawn)[:steps]


def charged_start(table: RecordedTable, row: RecordedBurst, request: BurstRequest) -> ChargedStart:
    """Kept after a healthy replay in this process where the table recorded kept bursts (and this
    row one) and the request does not ask for new rank processes; else what the table and the
    request give."""
    start = table.start_for(request.replay_start)
    if (start == "warm" and table.kept_recorded and row.kept_startup_seconds is not None
            and not request.new_rank_processes and _healthy_before.get(str(request.replay_table), False)):
        return "kept"
    return start


def run_replay_rank(request: BurstRequest, device: object, reporter: Reporter | None = None) -> BurstResult:
    """One rank of a replayed multi-worker burst (a Ray Train worker group holding the recorded
    trial's slots): every rank serves the same row, so they report in lockstep."""
    return run_replay(request, reporter)


def run_replay(request: BurstRequest, reporter: Reporter | None = None) -> BurstResult:
    result = _replay(table_for(request), request, reporter)
    _healthy_before[str(request.replay_table)] = result.outcome in KEPT_OUTCOMES
    return result


def _replay(table: RecordedTable, request: BurstRequest, reporter: Reporter | None) -> BurstResult:
    row = table.row(request.config)
    start = charged_start(table, row, request)
    contract = Contract(trainable="replay", replayed_from=request.replay_table, recorded=row.contract, rank_start=start)
    elapsed = row.startup(start)
    records: list[StepRecord] = []
    peak = int((row.peak_memory_gib or 0.0) * GIB)
    step_seconds = replayed_step_seconds(row, request.steps, request.seed, request.config.describe())
    if start == "kept" and step_seconds and row.kept_first_step_seconds is not None:
        step_seconds[0] = row.kept_first_step_seconds
    for step, seconds in enumerate(step_seconds):
        elapsed += seconds
        record = StepRecord(
            step=step, step_seconds=seconds, data_wait_seconds=0.0, vision_seconds=0.0, projector_seconds=0.0,
            decoder_seconds=0.0, useful_tokens=row.useful_tokens_per_step, image_tokens=0, loss_tokens=0,
            samples=0, model_flops=0.0, peak_memory_bytes=peak, loss=0.0,
        )
        records.append(record)
        report = StepReport(record, Evidence(), contract=contract if step == 0 else None, elapsed_seconds=elapsed)
        if reporter is not None and not reporter(report):
            return BurstResult("pruned", tuple(records), contract, elapsed_seconds=elapsed, rank_start=start)
    outcome = row.outcome
    return BurstResult(outcome, tuple(records), contract if outcome == "ok" else None, row.error,
                       elapsed_seconds=elapsed, rank_start=start)
