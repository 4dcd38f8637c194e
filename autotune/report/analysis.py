"""What a finished (or stopped) campaign's run directory says, computed once for every view.

Everything here is read from the run directory's own records — ``trials.jsonl``, ``steps.jsonl``,
the study journal, ``probe.json`` — never re-measured or estimated; the leaderboard and the spend
are derived from ``trials.jsonl`` as the campaign derives them, so a campaign stopped before writing
``leaderboard.json`` or ``spend.json`` reports the same way. The HTML page, the terminal summary and
``autotune compare`` all show these numbers.
"""

from __future__ import annotations

import json
import logging
import statistics
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.campaign import freezing_warning
from autotune.core.contract import Contract
from autotune.core.knobs import KNOBS
from autotune.engine.promotion import BRING_UP, Gain, Leaderboard, Verdict, decide, gain_at_equal_fidelity, leaderboard
from autotune.engine.records import Spend, TrialEntry, spend
from autotune.engine.rundir import PROBE_FILE, RunDir, open_run_dir

log = logging.getLogger(__name__)

STAGE_PARTS = ("vision_seconds", "projector_seconds", "decoder_seconds", "data_wait_seconds")
"""The parts of a step the trainables time separately (the dispatcher runs inside the decoder)."""
SHAPE_CHECKED = frozenset({"micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size"})
"""Knobs the contract's ``shapes`` show as run; every other tuned knob needs the trainable's evidence."""
OUTCOMES = ("ok", "pruned", "oom", "invalid", "failed", "hung", "oom_predicted")


@dataclass(frozen=True)
class Flag:
    """Something a reader must know before trusting the numbers."""

    severity: str
    """``warning`` (the result may not mean what it seems) or ``note``."""
    text: str


@dataclass(frozen=True)
class StageSplit:
    """Where a trial's steady steps went, in seconds per step (means over its steady window)."""

    trial_id: str
    label: str
    step_seconds: float
    parts: dict[str, float]
    """``vision_seconds`` … ``data_wait_seconds``; what is left of the step is ``other_seconds``."""

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.step_seconds - sum(self.parts.values()))


@dataclass(frozen=True)
class SlicePoint:
    """One screening trial on one knob's slice."""

    value: str
    objective: float
    outcome: str
    trial_id: str


@dataclass(frozen=True)
class MemoryPoint:
    """A finished trial's objective against its peak memory."""

    trial_id: str
    stage: str
    objective: float
    peak_gib: float
    outcome: str
    config: str
    pareto: bool
    """No other point has more useful tokens/s for no more memory."""


@dataclass(frozen=True)
class DeviceHours:
    by_stage: dict[str, float]
    by_outcome: dict[str, float]
    total: float


@dataclass
class RunReport:
    path: Path
    campaign: str
    objective: str
    """The objective's name, a per-device rate (``useful_tokens_per_s_per_gpu`` by default)."""
    world_size: int
    """Devices per trial."""
    entries: list[TrialEntry]
    verdict: Verdict
    board: Leaderboard
    baselines: list[TrialEntry]
    """The best screening run of each warm start (bring-up first), as the winner's yardstick."""
    spend: Spend
    tuned_knobs: list[str]
    importances: dict[str, dict[str, float]]
    """Per study (one per space): Optuna's parameter importances (fANOVA) over the trials that ran."""
    stage_splits: list[StageSplit]
    contract: Contract | None
    """The winner's measurement contract (else the first recorded one)."""
    probe: list[dict[str, Any]] | None
    """What the campaign's nodes run (``probe.json``, one probe per node), which the configs were judged against."""
    flags: list[Flag] = field(default_factory=list)

    # -- views ---------------------------------------------------------------------------------
    def launched(self, stage: str | None = None) -> list[TrialEntry]:
        return [e for e in self.entries if e.launched and (stage is None or e.stage == stage)]

    @property
    def winner(self) -> TrialEntry | None:
        return self.verdict.winner

    @property
    def bring_up(self) -> TrialEntry | None:
        """The space's ``bring-up`` warm start as screened (the seed's FSDP-first starting point)."""
        return next((b for b in self.baselines if b.warm_start == BRING_UP), None)

    @property
    def bring_up_promoted(self) -> TrialEntry | None:
        """Bring-up's config run as long as the promoted configs (promotion runs it for the gain)."""
        if self.bring_up is None:
            return None
        return next((e for e in self.verdict.promoted if e.config == self.bring_up.config), None)

    def gain_over_bring_up(self) -> Gain | None:
        """The winner over bring-up, both run for the promotion's steps; ``None`` when bring-up has
        no such run (it did not screen ok, or the run predates this): a long run over a short
        screen is never quoted."""
        if self.winner is None or self.bring_up_promoted is None:
            return None
        return gain_at_equal_fidelity(self.winner, self.bring_up_promoted)

    def device_hours(self) -> DeviceHours:
        return DeviceHours(by_stage={k: v / 3600 for k, v in self.spend.by_stage.items()},
                           by_outcome={k: v / 3600 for k, v in self.spend.by_outcome.items()},
                           total=self.spend.total / 3600)

    def knob_slices(self) -> dict[str, list[SlicePoint]]:
        """For each tuned knob, every screening trial's objective (ok or pruned) and its value."""
        screened = [e for e in self.launched("screen") if e.objective is not None and e.outcome in ("ok", "pruned")]
        return {knob: [SlicePoint(KNOBS[knob].format(e.config[knob]), e.objective, e.outcome, e.trial_id)
                       for e in screened]
                for knob in self.tuned_knobs}

    def memory_points(self) -> list[MemoryPoint]:
        """Finished trials with an objective and a peak memory, marked when on the Pareto front."""
        ran = [e for e in self.launched() if e.objective is not None and e.peak_memory_bytes
               and e.outcome in ("ok", "pruned")]

        def dominated(entry: TrialEntry) -> bool:
            return any(other.objective >= entry.objective and other.peak_memory_bytes <= entry.peak_memory_bytes
                       and (other.objective > entry.objective or other.peak_memory_bytes < entry.peak_memory_bytes)
                       for other in ran)

        return [MemoryPoint(e.trial_id, e.stage, e.objective, e.peak_memory_bytes / 2**30, e.outcome,
                            e.config.describe(), not dominated(e)) for e in ran]

    def outcome_map(self) -> dict[tuple[str, str], Counter]:
        """Outcomes of every proposal (launched or rejected) over MBS x recompute."""
        cells: dict[tuple[str, str], Counter] = defaultdict(Counter)
        for entry in self.entries:
            if entry.stage != "screen":
                continue
            config = entry.config
            recompute = config.recompute_granularity
            if recompute == "selective":
                recompute = f"selective {KNOBS['recompute_modules'].format(config['recompute_modules'])}"
            cells[(str(config.micro_batch_size), recompute)][entry.outcome] += 1
        return dict(cells)


def load_report(path: Path) -> RunReport:
    """Read a run directory into a :class:`RunReport` (a stopped campaign reports what it has)."""
    run_dir = open_run_dir(path)
    campaign = run_dir.load_campaign(check_inputs=False)
    entries = list(run_dir.trials.read())
    verdict = decide([e for e in entries if e.launched and e.stage == "promote"])
    tuned = list(dict.fromkeys([*campaign.space.tuned, *(campaign.next_space.tuned if campaign.next_space else [])]))
    report = RunReport(
        path=run_dir.path,
        campaign=campaign.spec.name,
        objective=campaign.spec.objective,
        world_size=campaign.spec.hardware.gpus_per_trial,
        entries=entries,
        verdict=verdict,
        board=leaderboard(entries, verdict),
        baselines=_baselines(entries),
        spend=spend(entries),
        tuned_knobs=tuned,
        importances=_importances(run_dir),
        stage_splits=_stage_splits(run_dir, entries, verdict),
        contract=verdict.winner.contract if verdict.winner is not None else
        next((e.contract for e in entries if e.contract is not None), None),
        probe=_read_json(run_dir.path / PROBE_FILE),
    )
    report.flags = _flags(report, campaign)
    return report


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _baselines(entries: list[TrialEntry]) -> list[TrialEntry]:
    best: dict[str, TrialEntry] = {}
    for entry in entries:
        if entry.launched and entry.stage == "screen" and entry.origin == "warm_start":
            held = best.get(entry.warm_start)
            if held is None or (entry.objective or 0) > (held.objective or 0):
                best[entry.warm_start] = entry
    return sorted(best.values(), key=lambda e: e.warm_start != BRING_UP)


def _importances(run_dir: RunDir) -> dict[str, dict[str, float]]:
    """fANOVA importances per study (one per space); a study too small to tell says nothing."""
    import optuna

    from autotune.search.proposer import journal_storage

    if not run_dir.study_path.is_file():
        return {}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = journal_storage(str(run_dir.study_path))
    found: dict[str, dict[str, float]] = {}
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        complete = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.user_attrs.get("outcome") in ("ok", "pruned")]
        if len(complete) < 3:
            continue
        ran = optuna.create_study(direction="maximize")  # only trials that ran: a rejection has no throughput
        ran.add_trials(complete)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found[summary.study_name] = optuna.importance.get_param_importances(
                    ran, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
        except (RuntimeError, ValueError) as exc:  # a single value everywhere: nothing to attribute
            log.info("no importances for %s: %s", summary.study_name, exc)
    return found


def _stage_splits(run_dir: RunDir, entries: list[TrialEntry], verdict: Verdict) -> list[StageSplit]:
    """The promoted runs (else the three best screened), split over their steady windows."""
    chosen = [e for e in entries if e.launched and e.stage == "promote" and e.outcome == "ok"]
    if not chosen:
        chosen = sorted((e for e in entries if e.launched and e.objective is not None), key=lambda e: -e.objective)[:3]
    chosen.sort(key=lambda e: -(e.objective or 0.0))
    wanted = {e.trial_id: e for e in chosen}
    records = defaultdict(list)
    for line in run_dir.steps.read():
        if line.trial_id in wanted:
            records[line.trial_id].append(line.record)
    splits = []
    for trial_id, entry in wanted.items():
        window = entry.contract.steady_window if entry.contract is not None else None
        first = window.first_step if window is not None else 0
        steady = [r for r in records[trial_id] if r.step >= first] or records[trial_id]
        if not steady:
            continue
        winner = verdict.winner is not None and verdict.winner.trial_id == trial_id
        splits.append(StageSplit(
            trial_id, ("winner: " if winner else "") + entry.config.describe(),
            statistics.fmean(r.step_seconds for r in steady),
            {part: statistics.fmean(getattr(r, part) for r in steady) for part in STAGE_PARTS}))
    return splits


def _flags(report: RunReport, campaign) -> list[Flag]:
    flags: list[Flag] = []
    launched = report.launched()
    mock = [e for e in launched if e.benchmark_only
            or (e.contract is not None and e.contract.data is not None and e.contract.data.realism == "mock")]
    if mock:
        flags.append(Flag("warning", f"mock (image-free) data in {len(mock)} trial(s): benchmark-only, "
                                     "never a throughput conclusion"))
    if not report.launched("screen"):
        flags.append(Flag("warning", "no screening trial finished"))
    if not report.launched("promote"):
        flags.append(Flag("warning", "promotion skipped: no config was re-run long, so there is no verified winner"))
    elif report.winner is None:
        flags.append(Flag("warning", f"no winner: {report.verdict.summary}"))
    if report.winner is not None and report.bring_up is not None and report.gain_over_bring_up() is None:
        flags.append(Flag("note", "no gain over bring-up is quoted: bring-up has no finished run as long as the "
                                  "winner's (only its screen, which never compares with a long run)"))
    if report.winner is not None:
        for part in campaign.frozen_beyond_workload(report.winner.config):
            flags.append(Flag("warning", freezing_warning(part)))
    if report.verdict.promoted and report.verdict.spread is None:
        flags.append(Flag("note", "each promoted config ran in one process: its interval says how well its steps pin "
                                  "that run's mean, not where another process of it lands "
                                  "(stages.promote_repeats ≥ 2 measures that and widens the intervals by it)"))
    if report.verdict.placements is not None and report.verdict.placements > 1:
        flags.append(Flag("warning", f"the promotion runs ran on {report.verdict.placements} different sets of nodes "
                                     "and devices (a node lost, or other GPUs of the node): the verdict's gaps hold "
                                     "the machines' differences, which reached 13–47 % between H100s"))
    screened_on = {worker.node_id for e in report.launched("screen") if e.contract is not None
                   for worker in e.contract.measured_on or ()}
    if len(screened_on) > 1:
        flags.append(Flag("note", f"the screens ran on {len(screened_on)} nodes: where machines differ, a screen's "
                                  "place among the others holds its node's speed (promotion compares on one)"))
    if report.verdict.tied:
        flags.append(Flag("warning", f"tie: {len(report.verdict.tied)} promoted config(s) within the winner's "
                                     "interval; the ranking between them is noise"))
    for entry, why in report.verdict.disqualified:
        flags.append(Flag("warning", f"{entry.trial_id} ruled out: {why}"))
    promoted = [e for e in report.launched("promote") if e.outcome == "ok"]
    # A knob a config leaves unset (the modules of no recompute, the scope of no graphs) has nothing to take effect.
    unchecked = sorted({knob for e in promoted for knob in report.tuned_knobs
                        if knob not in SHAPE_CHECKED and e.config.get(knob) is not None and knob not in e.evidence.checks})
    if unchecked:
        flags.append(Flag("warning", f"no runtime evidence that these tuned knobs took effect in the promoted "
                                     f"runs: {', '.join(unchecked)}"))
    if campaign.replay_table is not None or any(e.contract is not None and e.contract.trainable == "replay"
                                                 for e in launched):
        flags.append(Flag("note", "replayed from a recorded table: throughput as recorded, no stage split"))
    if not report.stage_splits or all(sum(s.parts.values()) == 0 for s in report.stage_splits):
        flags.append(Flag("note", "no stage split recorded (vision / projector / decoder)"))
    return flags
