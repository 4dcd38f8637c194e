"""One Ray Tune trial: run one burst of one config and report every step to Tune.

The trial reports a :class:`StepEvent` per training step (the step record, the objective, the run's
evidence, and the measurement contract on the first step), then an :class:`EndEvent` with the
outcome when the burst ends by itself; each travels in a Tune result as JSON, and the driver reads
it back typed (:func:`read_result`). When our scheduler stops the trial, Tune's ``report``
raises ``SystemExit`` in the trial thread; the reporter turns that into "stop after this step",
so the burst's ranks end cleanly and the driver already holds everything the trial measured.

Ranks start one of two ways (the campaign's ``hardware.launcher``):

- ``local``: the trainable's local launcher spawns the ranks on the trial's node (gloo on the
  CPU, NCCL on GPUs); the trial holds all of their CPU/GPU slots, on the node the searcher pinned
  it to (``nodes``: a promotion run's) through its placement group's label selector.
- ``ray_train``: a ``TorchTrainer`` worker group, one worker per rank, on any nodes; Ray Train sets
  up ``torch.distributed`` and Tune receives rank 0's reports through ``TuneReportCallback``. The
  searcher's ``placement`` (each worker's NVLink domain, :mod:`autotune.engine.placement`), or its
  ``nodes``, becomes the workers' label selectors.

Either way the contract records where each rank ran (``workers``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict
from ray import tune
from ray.tune import PlacementGroupFactory

from autotune.bursts import data_folder
from autotune.core.contract import (
    BurstRequest, BurstResult, Contract, Evidence, Outcome, RanksStarted, StepRecord, StepReport, TimedPart, WorkerPlacement,
)
from autotune.core.fabric import FabricRefused, placed_environment, planned_environment
from autotune.core.knobs import complete_config
from autotune.core.registry import REPLAY, burst_runner, rank_runner
from autotune.engine.placement import NODE_LABEL, NVLINK_DOMAIN_LABEL, domain_label, label_selectors
from autotune.engine.warm_ranks import zygote_address


TRIAL_DRIVER_CPU = 0.01
"""What a ``ray_train`` trial's own process holds: it only waits for its worker group."""
REPLAY_TRIAL_CPU = 0.01
"""What a replay trial holds: it reads a table; ``TrialJob.max_concurrent`` sets how many run at once."""
REUSE_WAIT_S = 60
"""How long Tune waits for a finished trial's thread (its burst's ranks ending) before it hands the
trial's process to the next trial (``TUNE_FUNCTION_THREAD_TIMEOUT_S``, 2 s by default: too short for
ranks that finish a step after a stop on a busy node). Ranks left stuck are killed after the
launcher's straggler grace (10 s), so a burst ends well within it."""
COLLECTIVE_TIMEOUT_S = 300
RAY_TRAIN_POLL_INTERVAL_S = 0.1
"""How often a worker group's controller collects its ranks' reports. A rank's report queue holds
one result, so ``ray.train.report`` blocks until the controller's next poll: at Ray's default
(2 s, ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``) no step of a burst could take less than 2 s."""


@dataclass(frozen=True)
class TrialJob:
    """What every trial of a stage shares; the per-trial part (config, steps) comes from the searcher."""

    trainable: str
    request: BurstRequest
    """A template: each trial replaces its config and steps."""
    launcher: Literal["local", "ray_train"]
    objective: str
    use_gpu: bool
    storage_path: str
    """Where Ray Train keeps its run folders (``ray_train`` launcher)."""

    data_source: str
    """The campaign's ``data.source``: built-in photos are built on first use on each node."""
    max_concurrent: int | None = None
    """At most this many trials at once (a replay keeps the recorded cluster's concurrency)."""
    warm_ranks: str | None = None
    """The campaign's token for its nodes' rank zygotes (:mod:`autotune.engine.warm_ranks`), which
    ``local`` trials fork their ranks from; ``None``: each trial starts its own."""
    accelerator: str = "cpu"
    gpus_per_node: int = 1
    imex_channel: bool = False
    """With the searcher's placement, what each GPU trial's fabric environment is planned from
    (:mod:`autotune.core.fabric`; the IMEX channel as the probe found it)."""

    def request_for(self, params: dict[str, Any]) -> BurstRequest:
        """The trial's burst; raises :class:`FabricRefused` where its placement cannot give HybridEP
        what it needs."""
        config = complete_config(params["config"])
        # A rehearsal on GPU nodes (a replay through Ray Train) gets what the recorded trainable would.
        environment = planned_environment(config, self.accelerator, self.gpus_per_node, self.request.world_size,
                                          params.get("placement"), self.imex_channel) if self.use_gpu else {}
        request = replace(self.request, config=config, steps=params["steps"], environment=environment,
                          new_rank_processes=params["new_rank_processes"])
        if self.trainable == REPLAY:
            return request
        folder = data_folder(self.data_source, self.request.data.folder, Path.cwd())
        return replace(request, data=replace(self.request.data, folder=str(folder)))

    def resources(self, params: dict[str, Any]) -> PlacementGroupFactory:
        """What Tune reserves for the trial's own process, on the node the searcher pinned a
        ``local`` trial to (``nodes``; a ``ray_train`` trial's workers are pinned instead)."""
        nodes = params.get("nodes")
        if nodes and self.launcher == "local":
            return PlacementGroupFactory([self.trial_resources()], bundle_label_selector=[{NODE_LABEL: nodes[0]}])
        return PlacementGroupFactory([self.trial_resources()])

    def trial_resources(self) -> dict[str, float]:
        """What Tune reserves for the trial's own process."""
        if self.trainable == REPLAY:
            return {"CPU": REPLAY_TRIAL_CPU}
        slots = self.request.world_size
        if self.launcher == "ray_train":
            return {"CPU": TRIAL_DRIVER_CPU}
        return {"CPU": 1, "GPU": slots} if self.use_gpu else {"CPU": slots}

    def worker_resources(self) -> dict[str, float]:
        """One ``ray_train`` worker's share: a GPU, or a CPU slot less the trial driver's share."""
        if self.use_gpu:
            return {"CPU": 1, "GPU": 1}
        return {"CPU": 1 - TRIAL_DRIVER_CPU / self.request.world_size}


def objective_value(objective: str, tokens_per_second: float, model_flops: float, step_seconds: float,
                    world_size: int) -> float:
    """The per-device figure a campaign maximises, from one step or a steady window."""
    if objective == "model_tflops_per_s_per_gpu":
        return model_flops / step_seconds / world_size / 1e12 if step_seconds > 0 else 0.0
    return tokens_per_second / world_size


class TrialStartup(BaseModel):
    """When the trial's function began, and when its reporting rank was ready and began its first
    step (``time.time()`` where each ran: one node for a local launch; a Ray Train worker on
    another node reads that node's clock, as close as the cluster keeps its clocks): what splits
    the trial's seconds outside its steps into Tune's start, the ranks' start and the build."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial_began_at: float
    ranks_ready_at: float
    first_step_at: float
    build_phases: tuple[TimedPart, ...] = ()
    """The reporting rank's set-up between the two, part by part, as its trainable timed it."""


class StepEvent(BaseModel):
    """A step as a trial reports it to the driver."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    objective: float
    """The step's value of the campaign's objective, per device."""
    record: StepRecord
    evidence: Evidence
    contract: Contract | None
    """The measurement contract, with the first step only."""
    elapsed_seconds: float | None
    """A replayed burst's recorded seconds since launch (see :class:`~autotune.core.contract.StepReport`)."""
    startup: TrialStartup | None = None
    """With the first step only, from a rank that spends real time."""


class EndEvent(BaseModel):
    """How a trial's burst ended, when it ended by itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outcome: Outcome
    error: str | None
    evidence: Evidence
    contract: Contract | None
    elapsed_seconds: float | None
    teardown: tuple[TimedPart, ...] = ()
    """From the last step's verdict to the ranks' exit, part by part (see :attr:`BurstResult.teardown`)."""
    rank_start: RanksStarted | None = None
    """How the burst's ranks started (see :attr:`BurstResult.rank_start`)."""
    before_first_step: tuple[TimedPart, ...] = ()
    """Where a burst that ran out of memory before its first step spent its seconds (see
    :attr:`BurstResult.before_first_step`)."""


def step_result(report: StepReport, objective: str, world_size: int, trial_began_at: float | None = None
                ) -> dict[str, Any]:
    """A Tune result for one step. The event travels as one JSON text (``payload``): Tune
    flattens nested result dicts; the objective also travels on its own, for the scheduler.
    ``trial_began_at``: when the trial's function began (``time.time()``), sent with the rank's start."""
    record = report.record
    value = objective_value(objective, record.tokens_per_second, record.model_flops, record.step_seconds, world_size)
    startup = None if report.startup is None or trial_began_at is None else TrialStartup(
        trial_began_at=trial_began_at, ranks_ready_at=report.startup.ready_at, first_step_at=report.startup.first_step_at,
        build_phases=report.build_phases)
    event = StepEvent(objective=value, record=record, evidence=report.evidence, contract=report.contract,
                      elapsed_seconds=report.elapsed_seconds, startup=startup)
    return {"event": "step", "objective": value, "payload": event.model_dump_json(exclude_unset=True)}


def end_result(result: BurstResult) -> dict[str, Any]:
    event = EndEvent(outcome=result.outcome, error=None if result.error is None else result.error[-4000:],
                     evidence=result.evidence, contract=result.contract, elapsed_seconds=result.elapsed_seconds,
                     teardown=result.teardown, rank_start=result.rank_start,
                     before_first_step=result.before_first_step)
    return {"event": "end", "payload": event.model_dump_json(exclude_unset=True)}


def read_result(result: dict[str, Any]) -> StepEvent | EndEvent | None:
    """The event a trial reported (``None`` for Tune's own results)."""
    kind = result.get("event")
    if kind == "step":
        return StepEvent.model_validate_json(result["payload"])
    if kind == "end":
        return EndEvent.model_validate_json(result["payload"])
    return None


def step_objective(result: dict[str, Any]) -> float | None:
    """The objective of a step result, without reading its payload; ``None`` for any other result."""
    return result["objective"] if result.get("event") == "step" else None


class _TuneReporter:
    """Reports each step to Tune, its contract told where the ranks run; a ``SystemExit`` from
    Tune (the scheduler stopped the trial) becomes "stop after this step"."""

    def __init__(self, job: TrialJob, began_at: float, workers: tuple[WorkerPlacement, ...]) -> None:
        self.job = job
        self.began_at = began_at
        self.workers = workers
        self.stopped = False

    def __call__(self, report: StepReport) -> bool:
        if report.contract is not None:
            report = replace(report, contract=report.contract.model_copy(update={"workers": self.workers}))
        try:
            tune.report(step_result(report, self.job.objective, self.job.request.world_size, self.began_at))
        except SystemExit:
            self.stopped = True
            return False
        return True


def run_trial(params: dict[str, Any], job: TrialJob) -> None:
    """The Tune function trainable."""
    began_at = time.time()
    try:
        request = job.request_for(params)
    except FabricRefused as exc:  # before any rank starts: it cost nothing
        tune.report(end_result(BurstResult(outcome="invalid", error=str(exc))))
        return
    os.environ["TUNE_FUNCTION_THREAD_TIMEOUT_S"] = str(REUSE_WAIT_S)  # read when Tune reuses this process
    if job.launcher == "local":
        context = ray.get_runtime_context()
        reporter = _TuneReporter(job, began_at, _placements(context, request.world_size))
        warm = None if job.warm_ranks is None else zygote_address(job.warm_ranks, context.get_node_id())
        result = burst_runner(job.trainable, warm)(request, reporter)
        if reporter.stopped:
            # Tune stopped the trial: end the thread as Tune's own report would have. Returning would
            # make Tune's wrapper report once more, and that report would wait forever in a process
            # Tune keeps for the next trial.
            raise SystemExit(0)
        if result.contract is not None:
            result = replace(result, contract=result.contract.model_copy(update={"workers": reporter.workers}))
        tune.report(end_result(result))
        return
    _run_on_ray_train(job, request, params, began_at)


def _run_on_ray_train(job: TrialJob, request: BurstRequest, params: dict[str, Any], began_at: float) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(RAY_TRAIN_POLL_INTERVAL_S))  # to the controller
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"job": job, "request": request, "trial_began_at": began_at},
        scaling_config=ScalingConfig(
            num_workers=request.world_size, use_gpu=job.use_gpu, resources_per_worker=job.worker_resources(),
            label_selector=label_selectors(params.get("placement"), domain_label(job.accelerator, job.imex_channel),
                                           params.get("nodes")),
        ),
        # A replay does no GPU work: its ranks talk over gloo wherever they are.
        torch_config=TorchConfig(backend="nccl" if job.use_gpu and job.trainable != REPLAY else "gloo",
                                 timeout_s=COLLECTIVE_TIMEOUT_S),
        run_config=RunConfig(
            name=f"burst-{tune.get_context().get_trial_id()}",
            storage_path=job.storage_path,
            callbacks=[TuneReportCallback()],
            # before the worker's CUDA context: Ray Train sets its device before the loop starts
            worker_runtime_env={"env_vars": dict(request.environment)},
        ),
    )
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - a worker group that fails is a failed trial, with why
        tune.report(end_result(BurstResult(outcome="failed", error=f"Ray Train: {type(exc).__name__}: {exc}")))


def _worker_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: run this rank of the burst; rank 0's reports reach Tune.

    Every rank reports every step (Ray Train gathers one report per rank), in lockstep because
    each step ends in collectives; only rank 0's metrics are forwarded, its contract with where
    every rank ran.
    """
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    job: TrialJob = config["job"]
    request: BurstRequest = config["request"]
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(device)  # before the first collective: NCCL gathers on the current device
    workers: list[Any] = [None] * request.world_size
    dist.all_gather_object(workers, _where_this_runs(ray.get_runtime_context()))
    where = {"workers": tuple(workers), "environment": dict(request.environment) or None}

    def report_step(report: StepReport) -> bool:
        if report.contract is not None:
            report = replace(report, contract=report.contract.model_copy(update=where))
        ray.train.report(step_result(report, job.objective, request.world_size, config["trial_began_at"])
                         if rank == 0 else {})
        return True

    misplaced = _misplaced(job, request, workers)
    result = (BurstResult(outcome="failed", error=misplaced) if misplaced is not None
              else rank_runner(job.trainable)(request, device, report_step))
    if result.contract is not None:
        result = replace(result, contract=result.contract.model_copy(update=where))
    ray.train.report(end_result(result) if rank == 0 else {})


def _misplaced(job: TrialJob, request: BurstRequest, workers: list[WorkerPlacement]) -> str | None:
    """Why the ranks' environment, planned before they started, does not fit where Ray put them
    (``None`` when it does): HybridEP would run with wrong domain settings."""
    if not request.environment:
        return None
    try:
        placed = placed_environment(request.config, job.accelerator, [w.node_id for w in workers],
                                    [w.nvlink_domain for w in workers], job.imex_channel)
    except FabricRefused as exc:
        return f"the ranks started where HybridEP cannot run: {exc}"
    if placed != dict(request.environment):
        return (f"the ranks were given {dict(request.environment)} for their planned placement, but where they "
                f"started needs {placed}")
    return None


def _where_this_runs(context: Any) -> WorkerPlacement:
    """This worker's node, NVLink domain (``None`` on a node without the label) and GPU."""
    return _placements(context, 1)[0]


def _placements(context: Any, ranks: int) -> tuple[WorkerPlacement, ...]:
    """Where each of ``ranks`` ranks started from this process runs: this process's node and
    domain, and its GPUs in order (the local launcher gives rank ``i`` the ``i``-th of them)."""
    domain = context.get_node_labels().get(NVLINK_DOMAIN_LABEL)
    gpus = context.get_accelerator_ids().get("GPU") or []
    return tuple(WorkerPlacement(node_id=context.get_node_id(),
                                 nvlink_domain=domain[0] if isinstance(domain, list) else domain,
                                 accelerator_id=str(gpus[rank]) if rank < len(gpus) else None)
                 for rank in range(ranks))
