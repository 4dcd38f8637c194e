"""What every measuring trainable's burst shares: the step loop, and the end of each step, where one
rank's measures become the step's :class:`~autotune.core.contract.StepRecord` for the whole trial.

A trainable times its own step and counts its batches (:class:`LocalMeasures`, :func:`count_batches`);
:func:`finish_step` does the rest the same way for all of them, so a record means the same thing
whichever trainable made it: times from the slowest rank, counts summed over ranks, the peak of the
fullest rank, the lowest GPU clock (:mod:`trainables.gpu_clock`), the loss averaged over the ranks
that compute one, and rank 0's reporter deciding whether every rank stops.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from autotune.core.contract import (
    BurstRequest, Contract, Evidence, Outcome, Reporter, StepRecord, StepReport, TimedPart,
)
from trainables.data.loader import MicroBatch
from trainables.flops import step_flops
from trainables.gpu_clock import HOLDING_REASONS, ClockReading, read_clock


def run_steps(device: torch.device, steps: int, train_step: Callable[[int], tuple[StepRecord, bool]],
              records: list[StepRecord]) -> Outcome:
    """Run up to ``steps`` steps; ``train_step(step)`` returns the step's record and whether the
    caller said stop. Records go into the caller's ``records`` as they finish, so a burst that
    fails mid-way still reports every step it completed. ``pruned`` when told to stop, else ``ok``.

    The ranks begin their first step together. Why: a step is timed on its slowest rank, and a rank
    whose build ended first would count its wait for the others inside its first step, as
    training; the reporting rank's build would then look shorter than its own timed parts (a CI
    run, 2026-12-06: 0.137 device-s of parts in a build of 0.096)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    for step in range(steps):
        record, stop = train_step(step)
        records.append(record)
        if stop:
            return "pruned"
    return "ok"


class BuildClock:
    """Times a burst's set-up (or its release) part by part (:class:`~autotune.core.contract.TimedPart`),
    so a trial's seconds outside its steps say where they went. On CUDA each part ends with a device
    synchronisation, unless told not to (a release after a failure, whose device may not answer):
    otherwise a part's queued kernels would be charged to the next one."""

    def __init__(self, device: torch.device, synchronize: bool = True) -> None:
        self.device = device
        self.synchronize = synchronize
        self.phases: list[TimedPart] = []
        self._since = time.perf_counter()

    def mark(self, name: str) -> None:
        """The part called ``name`` ends now (it began where the previous one ended)."""
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases.append(TimedPart(name, round(now - self._since, 4)))
        self._since = now

    def until(self, ending: str, part: str | None = None) -> tuple[TimedPart, ...]:
        """The parts timed so far and the one in progress (``part``, by default the one after the
        last timed), which ended now in ``ending``: where a burst that ended before its first step
        spent its seconds (it has no step report to send its set-up with). No device
        synchronisation: the device of a failed burst may not answer."""
        if part is None:
            part = f"after {self.phases[-1].name}" if self.phases else "the set-up"
        return (*self.phases, TimedPart(f"{part}, until {ending}", round(time.perf_counter() - self._since, 4)))


class RankRun(Protocol):
    """What :func:`finish_step` needs of a trainable's run on one rank."""

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def build_phases(self) -> Sequence[TimedPart]:
        """The run's set-up, part by part (its :class:`BuildClock`'s), sent with the first step."""
        ...

    def evidence(self) -> Evidence:
        """What the run has observed of its knobs so far."""
        ...

    def contract(self) -> Contract:
        """The measurement contract of the run."""
        ...


@dataclass(frozen=True, slots=True)
class StepCounts:
    """What one rank's micro-batches of a step held; summed over ranks into the step's record."""

    useful_tokens: int = 0
    image_tokens: int = 0
    loss_tokens: int = 0
    samples: int = 0
    model_flops: float = 0.0
    skipped_samples: int = 0


def count_batches(batches: Sequence[MicroBatch], request: BurstRequest) -> StepCounts:
    """The counts of the micro-batches one rank trained on in a step (FLOPs per ``trainables/flops.py``)."""
    config = request.config
    return StepCounts(
        useful_tokens=sum(batch.useful_tokens for batch in batches),
        image_tokens=sum(batch.image_tokens for batch in batches),
        loss_tokens=sum(batch.loss_tokens for batch in batches),
        samples=sum(batch.samples for batch in batches),
        model_flops=sum(step_flops(request.model, batch.segment_ids, batch.image_grids, config.freeze_vision_model,
                                   config.freeze_vision_projection) for batch in batches),
        skipped_samples=sum(sum(batch.skipped.values()) for batch in batches),
    )


@dataclass(frozen=True, slots=True)
class LocalMeasures:
    """One rank's measures of one step, before the cross-rank reduction."""

    step_seconds: float
    data_wait_seconds: float
    vision_seconds: float
    projector_seconds: float
    peak_memory_bytes: int
    counts: StepCounts = StepCounts()
    """Zero on a rank that does not count the step's data (megatron: all but the first pipeline
    stage's tensor-rank 0 of each data-parallel replica, whose peers saw the same batches), so the
    sum over ranks counts every sample once."""
    loss: float | None = None
    """This rank's loss; ``None`` on a rank that computes none (megatron: all but the last
    pipeline stage's tensor-rank 0)."""


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this rank has held: allocated device memory on CUDA, the process's peak
    resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def finish_step(run: RankRun, step: int, local: LocalMeasures, reporter: Reporter | None) -> tuple[StepRecord, bool]:
    """Reduce ``local`` over the run's ranks into the step's record, report it, and agree on stopping.

    Every rank calls this after every step (it holds collectives, on the run's device so NCCL can
    reduce them; one rank uses none). ``reporter`` (rank 0's, where there is one) gets a
    :class:`StepReport` with the evidence so far and, at step 0, the contract; its ``False`` on
    rank 0 stops every rank after this step. Returns the record and whether to stop.
    """
    first = step == 0
    # when this rank began its first step, taken before the reduction, which waits for the slowest rank
    began_at = time.time() - local.step_seconds if first else None
    times, counts, peak, clock = _reduce(run, local, read_clock(run.device))
    step_seconds, data_wait, vision, projector = times
    useful, image, loss_tokens, samples, flops, skipped, loss_sum, loss_ranks = counts
    record = StepRecord(
        step=step,
        step_seconds=step_seconds,
        data_wait_seconds=data_wait,
        vision_seconds=vision,
        projector_seconds=projector,
        decoder_seconds=step_seconds - data_wait - vision - projector,
        useful_tokens=int(useful),
        image_tokens=int(image),
        loss_tokens=int(loss_tokens),
        samples=int(samples),
        model_flops=flops,
        peak_memory_bytes=int(peak),
        loss=loss_sum / max(loss_ranks, 1.0),
        skipped_samples=int(skipped),
        sm_clock_mhz=None if clock is None else clock.sm_clock_mhz,
        clock_held_by=() if clock is None else clock.held_by,
    )
    stop = False
    if reporter is not None:
        report = StepReport(record, run.evidence(), run.contract() if first else None,
                            build_phases=tuple(run.build_phases) if first else (), began_at=began_at)
        stop = not reporter(report) and run.rank == 0
    return record, _rank_zero_says(run, stop)


def _reduce(run: RankRun, local: LocalMeasures,
            clock: ClockReading | None) -> tuple[list[float], list[float], float, ClockReading | None]:
    """(times of the slowest rank, counts summed over ranks, the largest peak, the lowest clock with
    what held any rank's down; ``None`` where no rank read one)."""
    times = torch.tensor([local.step_seconds, local.data_wait_seconds, local.vision_seconds,
                          local.projector_seconds], dtype=torch.float64, device=run.device)
    # The loss travels as a sum with the number of ranks that computed one, to average over those.
    counted = local.counts
    counts = torch.tensor([counted.useful_tokens, counted.image_tokens, counted.loss_tokens, counted.samples,
                           counted.model_flops, counted.skipped_samples, 0.0 if local.loss is None else local.loss,
                           0.0 if local.loss is None else 1.0], dtype=torch.float64, device=run.device)
    # One maximum reduces the peak, the clock (its negative: the lowest clock; -inf where a rank read
    # none) and each holding reason (1 where it held a rank's clock).
    reasons = clock.held_by if clock is not None else ()
    maxima = torch.tensor([float(local.peak_memory_bytes), -clock.sm_clock_mhz if clock is not None else -math.inf,
                           *(float(name in reasons) for name in HOLDING_REASONS)], dtype=torch.float64, device=run.device)
    if run.world_size > 1:
        # The slowest rank's times, whole: its stages add up to its step, another rank's would not.
        gathered = [torch.empty_like(times) for _ in range(run.world_size)]
        dist.all_gather(gathered, times)
        times = max(gathered, key=lambda row: row[0].item())
        dist.all_reduce(counts)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    peak, negative_clock, *held = maxima.tolist()
    lowest = None if negative_clock == -math.inf else \
        ClockReading(-negative_clock, tuple(name for name, flag in zip(HOLDING_REASONS, held) if flag))
    return times.tolist(), counts.tolist(), peak, lowest


def _rank_zero_says(run: RankRun, stop: bool) -> bool:
    """Rank 0's ``stop``, on every rank: all ranks must leave the loop at the same step, or those
    that stay wait forever in the next step's collectives."""
    if run.world_size == 1:
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], dtype=torch.float64, device=run.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
