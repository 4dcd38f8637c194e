"""The search-efficiency benchmark: how much device time each way of searching needs to find the
best config of a recorded table (autotune/core/tables.py), replayed through the same burst contract.

Methods, per seed:

- ``autotune``: our campaign engine as the table's campaign configures it (rules, sampler, OOM
  feedback, memory model, pruning, steady-state stopping, promotion) on Ray Tune, running the
  replay trainable; ``autotune_no_memory_model`` the same without the memory model, to show what
  the model's rejections save.
- ``random``: configs of the space in a random order, rules ignored, each screened for the
  campaign's screen length; no pruning, no stopping early.
- ``tpe``: plain Optuna TPE (its defaults) over the space's knobs, rules ignored, a failed burst
  told as failed (no OOM feedback), each screened for the campaign's screen length.
- ``grid``: every config screened, the best promoted (the denominator).

Truth is the table: a config's steady useful tokens/s per device over its recorded steady window,
for configs Megatron would run. A config that megatron-core, Megatron-LM or the stack rejects (our
rules with those sources) cannot be handed to a user: a method without our rules that launches one
pays its recorded start-up and gets ``invalid``, as a Megatron launch that fails at construction
would (a native-trainable table may have recorded it running). The best is over the others.
A method *reaches* 98 % when a config within 98 % of the table's best is promoted (promotion of
``promote_steps`` steps, charged). Baselines are given the benefit of the doubt: they promote
their best-screened config after every screen at no cost until the promoted one is good enough,
then pay that one promotion. Each seed's *budget* is what our tuner spent on it; at that spend a
baseline hands the user its best-screened config, ours its winner. Device-seconds are the recorded
ones (start-up included) times the devices a burst ran on. Every method pays the same start-up:
warm (ranks forked from a zygote already running, as our campaigns start them) where the table
recorded it, cold otherwise or when asked; and where every row recorded a burst in kept ranks, a
screen after a healthy burst pays that burst's start-up and first step, as a campaign's screen in
the ranks its slot kept does (a search's first screen and every promotion start new rank
processes; a baseline's launch of a config Megatron rejects is charged the warm start-up).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any, Callable

import optuna
from rich.console import Console

from autotune.campaign import Campaign, WorkloadSection, load_campaign
from autotune.core.contract import FAILED_OUTCOMES, RankStart
from autotune.core.errors import AutotuneError
from autotune.core.knobs import FREEZE_KNOBS_BY_PART, Config
from autotune.core.registry import REPLAY, burst_runner
from autotune.core.steady import steady_state
from autotune.core.tables import RecordedBurst, RecordedTable, TableError
from autotune.engine.driver import run_campaign
from autotune.engine.live import LiveView
from autotune.engine.probe import apply_probe, recorded_probes
from autotune.engine.rundir import create_run_dir
from autotune.rules import violations
from autotune.search.encoding import suggest_config

REACH = 0.98


def deployable(campaign: Campaign, config: Config) -> bool:
    """Whether Megatron would run ``config``: no rule but our own no-op-duplicate rules rejects it."""
    return all(v.source == "autotune" for v in violations(config, campaign.rule_context))


def true_rate(row: RecordedBurst) -> float:
    """A recorded burst's steady useful tokens/s per device (0 for a burst that did not finish)."""
    if row.outcome != "ok":
        return 0.0
    estimate = row.steady
    return (estimate.mean if estimate is not None else statistics.mean(row.throughput)) / row.world_size


@dataclass(frozen=True)
class Truth:
    """The table's verdict: each deployable config's recorded steady rate, and the best of them."""

    rates: dict[Config, float]
    best: float

    def ratio(self, config: Config) -> float:
        """Over the best; 0 for a config Megatron would not run."""
        return self.rates.get(config, 0.0) / self.best


def truth(campaign: Campaign, table: RecordedTable) -> Truth:
    rates = {config: true_rate(row) for config, row in table.rows.items() if deployable(campaign, config)}
    best = max(rates.values(), default=0.0)
    if best <= 0:
        raise TableError(f"{table.path}: no deployable config finished")
    return Truth(rates, best)


@dataclass
class Trace:
    """One method's run on one seed: what it spent, and what it would hand the user when."""

    spent: float = 0.0
    wasted: float = 0.0
    """Device-seconds of bursts that ran out of memory, were invalid or failed."""
    reached_at: float | None = None
    """Device-seconds spent when a config within 98 % of the best was first promoted."""
    timeline: list[tuple[float, float]] = field(default_factory=list)
    """(device-seconds spent, truth ratio of the config the method would hand the user then)."""

    def ratio_at(self, budget: float) -> float:
        within = [ratio for spent, ratio in self.timeline if spent <= budget]
        return within[-1] if within else 0.0


def replay_campaign(table: RecordedTable, seed: int, output_dir: Path, memory_model: bool = True,
                    start: RankStart = "warm") -> Campaign:
    """The campaign the table was recorded for, replaying it with ``seed``, charging ``start``
    start-up where the table has it (:attr:`RecordedTable.charged_start`)."""
    recorded = {row.contract.get("campaign") for row in table.rows.values()}
    if len(recorded) != 1 or None in recorded:
        raise TableError(f"{table.path}: rows must name one campaign (contract.campaign), found {sorted(map(str, recorded))}")
    path = Path(recorded.pop())
    if not path.is_file():
        raise TableError(f"{table.path}: its campaign {path} is not here (run from the folder it was recorded in)")
    campaign, _ = apply_probe(load_campaign(path, recorded_workload(table)), recorded_probes(table))
    table.require_complete(campaign.space)
    hardware = campaign.spec.hardware
    if hardware.accelerator == "cpu":  # the counted device memory the rows ran with, if any
        counted = recorded_counted_memory(table)
        hardware = hardware.model_copy(update={"cpu_device_memory_gib": None if counted is None else counted / 2**30})
    spec = campaign.spec.model_copy(update={
        "search": campaign.spec.search.model_copy(update={"seed": seed, "memory_model": memory_model}),
        "hardware": hardware,
        "output_dir": str(output_dir),
    })
    return dataclasses.replace(campaign, spec=spec, replay_table=table.path.resolve(),  # trials run elsewhere
                               replay_start=table.start_for(start))


def recorded_counted_memory(table: RecordedTable) -> int | None:
    """The counted device memory a CPU table's rows ran with (their peaks are in that count), or
    ``None`` for a table recorded without one (peaks are resident sets)."""
    counted = {(row.contract.get("hardware") or {}).get("counted_memory_bytes") for row in table.rows.values()
               if row.contract.get("hardware")}
    if len(counted) > 1:
        raise TableError(f"{table.path}: rows ran with different counted device memories {sorted(map(str, counted))}")
    return counted.pop() if counted else None


def recorded_workload(table: RecordedTable) -> WorkloadSection:
    """The workload the table's rows ran: their global batch where all ran the same one, and each
    part frozen where every row froze it, tuned where rows differ (tables recorded before the
    workload was declared varied both)."""
    batches = {row.contract.get("shapes", {}).get("global_batch_size") for row in table.rows.values()} - {None}
    frozen, varied = [], False
    for part, knob in FREEZE_KNOBS_BY_PART.items():
        values = {config[knob] for config in table.rows}
        frozen += [part] if values == {True} else []
        varied |= len(values) > 1
    return WorkloadSection(global_batch_size=batches.pop() if len(batches) == 1 else None, frozen=frozen,
                           tunable_freezing=varied)


class Replayer:
    """Screens and promotes configs of one campaign by replaying its table, without the engine."""

    def __init__(self, campaign: Campaign, table: RecordedTable, truth: Truth, seed: int) -> None:
        self.campaign, self.table, self.truth, self.seed = campaign, table, truth, seed
        self.run = burst_runner(REPLAY)

    def ratio(self, config: Config) -> float:
        return self.truth.ratio(config)

    def burst(self, config: Config, steps: int, new_rank_processes: bool) -> tuple[float, float | None, str]:
        """Device-seconds, steady estimate per device (``None`` unless it finished) and outcome;
        ``new_rank_processes`` as a campaign asks for them (its first trial, a promotion)."""
        if config not in self.truth.rates:  # Megatron would reject it at construction
            row = self.table.row(config)
            return row.startup(self.campaign.replay_start) * row.world_size, None, "invalid"
        request = dataclasses.replace(self.campaign.burst_request(config, steps), seed=self.seed,
                                      new_rank_processes=new_rank_processes)
        result = self.run(request)
        cost = (result.elapsed_seconds or 0.0) * request.world_size
        if result.outcome != "ok":
            return cost, None, result.outcome
        estimate = steady_state([r.tokens_per_second for r in result.records],
                                min_warmup=self.campaign.spec.stages.warmup_steps)
        return cost, None if estimate is None else estimate.mean / request.world_size, result.outcome

    def search(self, propose: Callable[[], Config | None], tell: Callable[[Config, float | None], None],
               budget: float) -> Trace:
        """Screen what ``propose`` gives until it gives nothing or ``budget`` is spent; the best
        screened config is the one promoted (see the module's docstring)."""
        stages = self.campaign.spec.stages
        trace, incumbent, incumbent_value = Trace(), None, float("-inf")
        screens = 0
        while trace.spent < budget and (config := propose()) is not None:
            cost, value, outcome = self.burst(config, stages.screen_steps, new_rank_processes=screens == 0)
            screens += 1
            trace.spent += cost
            trace.wasted += cost if outcome in FAILED_OUTCOMES else 0.0
            tell(config, value)
            if value is not None and value > incumbent_value:
                incumbent, incumbent_value = config, value
            if incumbent is None:
                continue
            trace.timeline.append((trace.spent, self.ratio(incumbent)))
            if trace.reached_at is None and self.ratio(incumbent) >= REACH:
                trace.reached_at = trace.spent + self.burst(incumbent, stages.promote_steps, new_rank_processes=True)[0]
        return trace


def run_grid(replayer: Replayer) -> Trace:
    """Every config screened; its cost (with the best one's promotion) is the benchmark's unit."""
    configs = iter(replayer.campaign.space.configs())
    trace = replayer.search(lambda: next(configs, None), lambda config, value: None, budget=float("inf"))
    best = max(replayer.truth.rates, key=replayer.truth.rates.get)
    trace.spent += replayer.burst(best, replayer.campaign.spec.stages.promote_steps, new_rank_processes=True)[0]
    return trace


def run_random(replayer: Replayer, seed: int, budget: float) -> Trace:
    order = list(replayer.campaign.space.configs())
    random.Random(seed).shuffle(order)
    configs = iter(order)
    return replayer.search(lambda: next(configs, None), lambda config, value: None, budget)


def run_tpe(replayer: Replayer, seed: int, budget: float) -> Trace:
    """Plain Optuna TPE: its default sampler settings, the space's knobs, failures told as failed."""
    space = replayer.campaign.space
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    asked: dict[Config, list[optuna.Trial]] = {}

    def propose() -> Config:
        trial = study.ask()
        config = suggest_config(trial, space)
        asked.setdefault(config, []).append(trial)
        return config

    def tell(config: Config, value: float | None) -> None:
        trial = asked[config].pop()
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)

    return replayer.search(propose, tell, budget)


def run_autotune(campaign: Campaign, verdict: Truth) -> Trace:
    """Our engine on Ray Tune, replaying; the trace read from its run directory in finishing order
    (the recorded campaigns run one trial at a time)."""
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        outcome = run_campaign(campaign, run_dir, view)
    trace = Trace()
    for entry in run_dir.trials.read():
        trace.spent += entry.device_seconds
        trace.wasted += entry.device_seconds if entry.outcome in FAILED_OUTCOMES else 0.0
        if entry.stage == "promote" and entry.outcome == "ok":
            trace.timeline.append((trace.spent, verdict.ratio(entry.config)))
            if trace.reached_at is None and verdict.ratio(entry.config) >= REACH:
                trace.reached_at = trace.spent
    if outcome.verdict.winner is not None:  # what the user gets: the winner, once everything is spent
        trace.timeline.append((trace.spent, verdict.ratio(outcome.verdict.winner.config)))
    return trace


def benchmark(table: RecordedTable, seeds: int, start: RankStart = "warm") -> dict[str, Any]:
    """The benchmark's JSON object over seeds 0 … ``seeds``-1 (Ray must be connected), every burst
    charged ``start`` start-up where the table recorded it."""
    if seeds < 1:
        raise AutotuneError("--seeds must be at least 1")
    traces: dict[str, list[Trace]] = {"autotune": [], "autotune_no_memory_model": [], "random": [], "tpe": []}
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as folder:
        first = replay_campaign(table, 0, Path(folder), start=start)
        verdict = truth(first, table)
        grid = run_grid(Replayer(first, table, verdict, 0))
        for seed in range(seeds):
            campaign = replay_campaign(table, seed, Path(folder), start=start)
            traces["autotune"].append(run_autotune(campaign, verdict))
            without = replay_campaign(table, seed, Path(folder), memory_model=False, start=start)
            traces["autotune_no_memory_model"].append(run_autotune(without, verdict))
            replayer = Replayer(campaign, table, verdict, seed)
            traces["random"].append(run_random(replayer, seed, budget=grid.spent))
            traces["tpe"].append(run_tpe(replayer, seed, budget=grid.spent))
    # Each seed's budget is what our tuner spent on it: the baselines are judged at the same spend.
    budgets = [trace.spent for trace in traces["autotune"]]
    return {
        "table": str(table.path),
        "configs": len(table.rows),
        "seeds": seeds,
        "start_up_charged": first.replay_start,
        "kept_ranks_charged": first.replay_start == "warm" and table.kept_recorded,
        "grid_gpu_seconds": grid.spent,
        "best_tokens_per_s": verdict.best,  # per device
        "median_budget_gpu_seconds": statistics.median(budgets),
        "methods": {name: _summary(runs, grid.spent, budgets) for name, runs in traces.items()},
    }


def _summary(runs: list[Trace], grid_seconds: float, budgets: list[float]) -> dict[str, float]:
    """Never reaching 98 % counts as the whole spend over the grid's, and at least 1.0."""
    fractions = [t.reached_at / grid_seconds if t.reached_at is not None else max(1.0, t.spent / grid_seconds)
                 for t in runs]
    return {
        "median_fraction_of_grid_to_98pct": statistics.median(fractions),
        "success_rate": sum(t.reached_at is not None and t.reached_at <= b for t, b in zip(runs, budgets)) / len(runs),
        "median_best_ratio_at_budget": statistics.median(t.ratio_at(b) for t, b in zip(runs, budgets)),
        "wasted_fraction_oom_invalid": sum(t.wasted for t in runs) / max(sum(t.spent for t in runs), 1e-9),
    }
