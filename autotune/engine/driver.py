"""``autotune run`` and ``autotune resume``: a campaign as Ray Tune stages on a Ray cluster.

Screening: the Optuna study proposes configs (rules and OOM record filter them first), each runs
as a short Tune trial that our scheduler stops when steady or prunes when it cannot catch the
best. Promotion: the best distinct configs re-run for ``promote_steps``; the verdict says whether
the winner beats the others beyond their intervals; the winner is exported. Budget limits end
screening early, never promotion of what screening found.
"""

from __future__ import annotations

import errno
import logging
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

import ray
from ray import tune

from autotune.campaign import Campaign
from autotune.core.errors import AutotuneError
from autotune.core.knobs import Config, complete_config
from autotune.core.registry import REPLAY
from autotune.core.tables import load_table
from autotune.durable import OutputUnwritable
from autotune.engine.faults import exception_chain
from autotune.engine.ledger import Ledger
from autotune.engine.live import LiveView
from autotune.engine.placement import NODE_LABEL, NVLINK_DOMAIN_LABEL, DomainPlanner, domain_label, domains_labelled
from autotune.engine.probe import apply_probe, probe_cluster, recorded_probes
from autotune.engine.promotion import Verdict, decide, leaderboard, projected_headroom, promotion_candidates
from autotune.engine.records import Spend, Stage
from autotune.engine.rundir import (
    LEADERBOARD_FILE, PROBE_FILE, SPEND_FILE, WINNER_FILE, RunDir, open_run_dir,
)
from autotune.engine.trial import TrialJob, run_trial
from autotune.engine.warm_ranks import warm_ranks
from autotune.export import document
from autotune.search.proposer import Proposer
from autotune.space import SearchSpace


NO_TUNE_LOGGERS = "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EIO}
"""Write failures that mean the output directory cannot take more: full, quota, read-only, too
large, permissions changed, or the device failed."""


@dataclass(frozen=True)
class CampaignOutcome:
    run_dir: RunDir
    verdict: Verdict
    spend: Spend


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``, which ``ray job submit`` sets for
    its jobs); without one, start a new local single-node cluster (never a stray one running here)."""
    # Our live view replaces Tune's console output.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if ray.is_initialized():
        return
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False,
             configure_logging=False)


def run_campaign(campaign: Campaign, run_dir: RunDir, view: LiveView) -> CampaignOutcome:
    # A replay judges configs against the stack its table was recorded on.
    probes = recorded_probes(load_table(campaign.replay_table)) if campaign.replay_table is not None else \
        probe_cluster("GPU" if campaign.stack.has_cuda else None)
    run_dir.write_json(PROBE_FILE, probes)
    campaign, changes = apply_probe(campaign, probes)
    for change in changes:
        view.note(f"capability probe: {change}; the rules use what the nodes run")
    spec = campaign.spec
    ledger = Ledger(
        run_dir,
        world_size=spec.hardware.gpus_per_trial,
        warmup_steps=spec.stages.warmup_steps,
        target_relative_half_width=spec.stages.target_relative_half_width,
        benchmark_only=spec.data.realism == "mock",
    )
    job = _trial_job(campaign, run_dir)
    limit = memory_limit_bytes(campaign, probes)
    # Local trials fork their ranks from a zygote per node that outlives them (start-up cost).
    with warm_ranks(job.trainable if job.launcher == "local" and job.trainable != REPLAY else None) as token:
        job = replace(job, warm_ranks=token)
        _tune_spaces(campaign, run_dir, ledger, job, view, limit, _domain_planner(job, view))
    verdict = decide(ledger.launched("promote"))
    run_dir.write_json(LEADERBOARD_FILE, leaderboard(ledger.entries, verdict).model_dump(mode="json"))
    spend = ledger.spend()
    run_dir.write_json(SPEND_FILE, spend.model_dump(mode="json"))
    if verdict.winner is not None:
        _write_winner(run_dir, campaign, verdict)
    return CampaignOutcome(run_dir, verdict, spend)


def _tune_spaces(campaign: Campaign, run_dir: RunDir, ledger: Ledger, job: TrialJob, view: LiveView,
                 limit: float | None, planner: DomainPlanner | None) -> None:
    """Tune the campaign's space, then its workflow's next space if the projected headroom pays."""
    spec = campaign.spec
    _tune_space(campaign, campaign.space, spec.name, run_dir, ledger, job, view, limit, planner)
    if campaign.next_space is None:
        return
    headroom = projected_headroom(ledger.launched("promote", campaign.space.name),
                                  campaign.next_space.reachable.model_tflops_per_s_per_gpu)
    threshold = spec.workflow.min_headroom
    if headroom is None:
        view.note(f"{campaign.next_space.name} skipped: {campaign.space.name} promoted nothing to project from")
    elif headroom <= threshold:
        view.note(f"{campaign.next_space.name} skipped: projected headroom {100 * headroom:+.1f}% "
                  f"is within the {100 * threshold:.0f}% threshold")
    else:
        view.note(f"{campaign.next_space.name}: projected headroom {100 * headroom:+.1f}% "
                  f"(over {100 * threshold:.0f}%), tuning it")
        _tune_space(campaign, campaign.next_space, f"{spec.name}:{campaign.next_space.name}", run_dir, ledger,
                    job, view, limit, planner)


def memory_limit_bytes(campaign: Campaign, probes: list[dict]) -> float | None:
    """What one device may hold: the cap's share of the smallest probed GPU; on the CPU, the
    counted device memory where the campaign gives its ranks one (peaks are reported in that count),
    else ``None`` (peaks are then the ranks' resident sets, and an address-space cap is not the
    same measure)."""
    hardware = campaign.spec.hardware
    if campaign.stack.accelerator == "cpu":
        return hardware.cpu_device_memory_bytes
    devices = [p["device_memory_bytes"] for p in probes if p.get("device_memory_bytes")]
    return (hardware.memory_cap_fraction or 1.0) * min(devices) if devices else None


def _domain_planner(job: TrialJob, view: LiveView) -> DomainPlanner | None:
    """NVLink-domain placement for trials whose GPU workers Ray Train places (several nodes)."""
    if job.launcher != "ray_train" or not job.use_gpu:
        return None
    planner = DomainPlanner.from_nodes(ray.nodes(), domain_label(job.accelerator, job.imex_channel))
    if not planner.capacity:
        return None
    if planner.label == NODE_LABEL:
        view.note(f"NVLink domains: the {len(planner.capacity)} trays themselves (their processes hold no IMEX channel)")
    else:
        view.note("NVLink domains: " + ", ".join(f"{d} ({gpus} GPUs)" for d, gpus in sorted(planner.capacity.items())))
    return planner


def _tune_space(campaign: Campaign, space: SearchSpace, study_name: str, run_dir: RunDir, ledger: Ledger,
                job: TrialJob, view: LiveView, memory_limit: float | None, planner: DomainPlanner | None) -> None:
    """Screen ``space`` within the budget, then promote its best configs."""
    from autotune.engine.tune_roles import (
        Budget, BudgetStopper, EarlyPromotion, HangWatchdog, ListSearcher, PinnedRunScheduler, RecordingCallback,
        ScreeningScheduler, StudySearcher,
    )

    spec = campaign.spec
    # Rules read whether the cluster's nodes say which NVLink domain they are in.
    labelled = planner is not None and (planner.label == NVLINK_DOMAIN_LABEL or domains_labelled(ray.nodes()))
    rule_context = replace(campaign.rule_context, nvlink_domains_labelled=labelled if job.use_gpu else None)
    proposer = Proposer(
        space, rule_context, run_dir.study_path, study_name,
        sampler=spec.search.sampler, seed=spec.search.seed, startup_trials=spec.search.startup_trials,
        memory=campaign.memory_model(memory_limit) if spec.search.memory_model else None,
        memory_frontier=spec.search.memory_frontier,
    )
    proposer.enqueue_warm_starts()
    for earlier in spec.search.warm_start_from:
        queued = proposer.warm_start_from(_earlier_trials(Path(earlier)), best=max(1, spec.search.startup_trials))
        view.note(f"warm start from {earlier}: {queued} config(s) queued")

    budget = Budget(campaign, ledger, space.name)
    callbacks = [RecordingCallback(ledger), HangWatchdog(ledger, spec.stages.hang_timeout_s)]
    view.attach(ledger, budget, space)
    if budget.trials_left() and not budget.exhausted() and not budget.plateaued():
        _run_stage(
            "screen", job, run_dir, view,
            searcher=StudySearcher(proposer, ledger, budget, spec.stages.screen_steps, planner,
                                   job.request.world_size,
                                   early=EarlyPromotion(spec.stages.promote_steps, spec.stages.prune_margin)
                                   if spec.stages.promote_early else None),
            scheduler=ScreeningScheduler(ledger, campaign),
            # each trial may run once more after losing its node
            samples=2 * budget.trials_left(), stopper=BudgetStopper(budget, ledger), callbacks=callbacks,
        )
        if (why := budget.exhausted() or budget.plateaued()) is not None:
            view.note(f"screening ended early: {why}")
    candidates = promotion_candidates(ledger.entries, spec.stages.promote_top_k, space.name,
                                      spec.stages.prune_margin, spec.stages.promote_repeats)
    if candidates:
        configs = len({launch.config for launch in candidates})
        view.note(f"promoting {configs} config(s) of {space.name} for {spec.stages.promote_steps} steps"
                  + (f", {len(candidates)} runs in fresh processes" if len(candidates) > configs else ""))
        _run_stage(
            "promote", job, run_dir, view,
            searcher=ListSearcher(candidates, ledger, spec.stages.promote_steps, planner, job.request.world_size),
            scheduler=PinnedRunScheduler(ledger),  # promotion runs every step: nothing to decide but where
            samples=2 * len(candidates), stopper=None, callbacks=callbacks,
        )


def resume_campaign(path: Path, view: LiveView) -> CampaignOutcome:
    run_dir = open_run_dir(path)
    return run_campaign(run_dir.load_campaign(), run_dir, view)


def _trial_job(campaign: Campaign, run_dir: RunDir) -> TrialJob:
    spec = campaign.spec
    hardware = spec.hardware
    # each trial brings its own config and steps
    template = campaign.burst_request(complete_config({}, defaults=campaign.space.fixed), spec.stages.screen_steps)
    replay = campaign.replay_table is not None
    # A replay runs in the driver's node unless the campaign asks for Ray Train explicitly: then
    # its workers hold the recorded trial's slots on the cluster (a rehearsal of its scheduling).
    rehearsal = replay and hardware.launcher == "ray_train"
    return TrialJob(
        trainable=REPLAY if replay else spec.trainable,
        request=template,
        launcher=hardware.resolved_launcher if rehearsal or not replay else "local",
        objective=spec.objective,
        use_gpu=hardware.accelerator != "cpu" and (rehearsal or not replay),
        storage_path=str(run_dir.ray_storage / "train"),
        data_source=spec.data.source,
        max_concurrent=campaign.trials_at_once if replay else None,
        accelerator=hardware.accelerator,
        gpus_per_node=hardware.gpus_per_node,
        imex_channel=campaign.stack.imex_channel,
    )


def _concurrency(job: TrialJob) -> int:
    """How many trials run at once: as many as the cluster's free slots hold (at least one when
    its total could hold one: the trial then waits for slots another job frees)."""
    per_trial = job.trial_resources()
    if job.launcher == "ray_train":
        per_worker = job.worker_resources()
        per_trial = {k: per_trial.get(k, 0) + per_worker.get(k, 0) * job.request.world_size
                     for k in {*per_trial, *per_worker}}

    def fits(resources: dict[str, float]) -> int:
        return min(int(resources.get(name, 0) / amount + 1e-9) for name, amount in per_trial.items() if amount > 0)

    total = ray.cluster_resources()
    if fits(total) < 1:
        raise AutotuneError(
            f"the Ray cluster has {', '.join(f'{k}={v:g}' for k, v in sorted(total.items()) if k in per_trial)} "
            f"in all, but one trial needs {', '.join(f'{k}={v:g}' for k, v in sorted(per_trial.items()))}"
        )
    at_once = max(1, fits(ray.available_resources()))
    return at_once if job.max_concurrent is None else min(at_once, job.max_concurrent)


def _run_stage(stage: Stage, job: TrialJob, run_dir: RunDir, view: LiveView, *,
               searcher, scheduler, samples: int, stopper, callbacks: list) -> None:
    """One Tune run; ``callbacks`` record every result (first: the view shows what they recorded)."""
    from ray.tune.search import ConcurrencyLimiter

    from autotune.engine.tune_roles import NotStartedGuard, ViewCallback

    attempt = sum(1 for p in run_dir.ray_storage.glob(f"{stage}-*")) + 1 if run_dir.ray_storage.exists() else 1
    view.stage(stage)
    # fit() still looks for the files of Tune's default loggers (off: see below) to build a result
    # grid the campaign never reads, and warns of each trial's missing files: not news.
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    # Trials whose ranks fork from the nodes' zygotes also reuse their own processes: a new Tune
    # trial process costs 1.96 s of its slots on the CPU demo's box (Ray's actor start, Tune's
    # setup), a reused one 0.26 s (bench/tune_trial_overhead.py). Each burst's ranks are still new
    # processes. Local replays reuse theirs too: a replay after a healthy one in the same process is
    # charged what a burst in the ranks the slot kept paid (trainables/replay/burst.py), as a
    # campaign's trial after a healthy one runs in the ranks its node's zygote kept.
    reuse = job.warm_ranks is not None or (job.trainable == REPLAY and job.launcher == "local")
    # Promotion runs one at a time, on the nodes its first run took (``promotion_nodes``): the
    # verdict's runs then differ by their configs, not by their machines or their neighbours.
    search_alg = ConcurrencyLimiter(searcher, max_concurrent=1 if stage == "promote" else _concurrency(job))
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(run_trial, job=job), job.resources),
        tune_config=tune.TuneConfig(
            search_alg=search_alg,
            scheduler=scheduler,
            num_samples=samples,
            # A ray_train trial's process ends with its trial, and its worker group goes with it.
            reuse_actors=reuse,
            trial_dirname_creator=lambda trial: trial.trial_id,
        ),
        run_config=tune.RunConfig(
            name=f"{stage}-{attempt}",
            storage_path=str(run_dir.ray_storage),
            stop=stopper,
            callbacks=[*callbacks, *([NotStartedGuard(searcher, search_alg)] if reuse else []),
                       ViewCallback(view.refresh)],
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    try:
        with _without_tune_loggers():
            tuner.fit()
        # Tune ends the trials still running when a stopper stops the whole run (the budget's
        # stop_all) without telling the searcher: end them here, so each is on record with the
        # steps it ran and the device-seconds it spent.
        for trial_id in list(searcher.ledger.live):
            searcher.on_trial_complete(trial_id)
    except Exception as exc:
        failure = _output_failure(exc)
        if failure is None:
            raise
        raise AutotuneError(
            f"{failure}; the campaign stopped. Everything it wrote before is intact: free the space "
            f"(or fix the permissions) and run `autotune resume {run_dir.path}`"
        ) from None


@contextmanager
def _without_tune_loggers() -> Iterator[None]:
    """Tune's default loggers would write every step result a second, third and fourth time under
    ray/ (JSON, CSV, and TensorBoard, which fsyncs each: the README's overhead row says what that
    cost the driver's loop); steps.jsonl is the record. Tune reads the switch when a run starts;
    it is put back after, so other Tune runs of this process (a user's, a test's) keep their logs."""
    before = os.environ.get(NO_TUNE_LOGGERS)
    os.environ[NO_TUNE_LOGGERS] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[NO_TUNE_LOGGERS]
        else:
            os.environ[NO_TUNE_LOGGERS] = before


def _output_failure(exc: BaseException) -> OSError | OutputUnwritable | None:
    """The disk failure behind an exception Tune raised, if it is one: our own line writes say
    :class:`OutputUnwritable`; the study journal and Tune's files raise a plain ``OSError``."""
    return next((e for e in exception_chain(exc)
                 if isinstance(e, OutputUnwritable) or (isinstance(e, OSError) and e.errno in DISK_ERRNOS)), None)


def _write_winner(run_dir: RunDir, campaign: Campaign, verdict: Verdict) -> None:
    import yaml

    winner = verdict.winner
    estimate = winner.estimate
    extra = {
        "campaign": campaign.spec.name,
        "objective": {"metric": campaign.spec.objective, "mean": winner.objective, "ci_low": estimate.ci_low,
                      "ci_high": estimate.ci_high, "confidence": estimate.confidence, "steady_steps": estimate.window,
                      "processes": winner.processes,
                      "process_spread": None if verdict.spread is None else asdict(verdict.spread)},
        "verdict": verdict.summary,
        "tied_with": [e.config.to_plain() for e in verdict.tied],
        "evidence": winner.evidence.model_dump(mode="json"),
        "contract": None if winner.contract is None else winner.contract.to_json(),
        "run_dir": str(run_dir.path.resolve()),
        "workload": campaign.spec.workload.model_dump(mode="json"),
        "frozen_beyond_workload": campaign.frozen_beyond_workload(winner.config),
        "tuned": campaign.tuned_knobs,
    }
    document_text = yaml.safe_dump(document(winner.config, campaign.stack.megatron_core, extra), sort_keys=False)
    run_dir.write_text(WINNER_FILE, document_text)


def _earlier_trials(path: Path) -> list[tuple[Config, str, float | None]]:
    return [(e.config, e.outcome, e.objective) for e in open_run_dir(path).trials.read()
            if e.launched and e.stage == "screen"]
