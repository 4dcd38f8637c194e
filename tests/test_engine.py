"""The campaign engine end to end: `autotune run` on a real local Ray cluster with the native
trainable on two gloo ranks per trial, and the parts that decide (ledger, promotion) on their own."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from autotune.core.contract import Contract, Evidence, WorkerPlacement
from autotune.core.knobs import KNOBS, complete_config
from autotune.core.steady import SteadyEstimate
from autotune.engine.promotion import (
    decide, early_promotion, gain_at_equal_fidelity, projected_headroom, promotion_candidates, promotion_nodes,
)
from autotune.engine.records import TrialEntry
from autotune.engine.rundir import RunDir
from autotune.core.tool_flags import BRIDGE_COMPANION_KEYS, read_bridge_overrides, read_megatron_lm_args
from autotune.export import FORMATS, load_document, render
from conftest import (
    NEXT_SPACE, OOM_CAP_GIB, OOM_SPACE, REPLAY_SPACE, SPACE, TEST_MODEL, autotune, campaign_file, entries,
    join_cluster, multi_node_cluster, only_run_dir,
)

ROOT = Path(__file__).resolve().parent.parent

def test_campaign_writes_every_output(campaign_run) -> None:
    run_dir, result = campaign_run
    for name in ("campaign.yaml", "space.yaml", "study.journal", "steps.jsonl", "trials.jsonl", "leaderboard.json",
                 "winner.yaml", "spend.json", "probe.json", "report.html"):
        assert (run_dir / name).is_file(), name
    records = entries(run_dir)
    launched = [e for e in records if e.launched]
    assert len([e for e in launched if e.stage == "screen" and e.space == "engine_test"]) == 4
    steps = list(RunDir(run_dir).steps.read())
    starts = set()
    for entry in launched:  # every step each trial reported is on record, with the contract
        assert len([s for s in steps if s.trial_id == entry.trial_id]) == entry.steps
        if entry.outcome in ("ok", "pruned"):
            assert entry.contract.data.realism == "real" and entry.contract.steady_window
            starts.add(entry.contract.rank_start)
    # ranks forked from the node's zygote, which the campaign kept across its trials, and once a
    # burst had ended healthy, that burst's rank processes, kept by the zygote
    assert starts == {"warm", "kept"}
    # but a promotion run starts new rank processes, as the user's own launch will
    promoted = [e for e in launched if e.stage == "promote" and e.contract is not None]
    assert promoted and {e.contract.rank_start for e in promoted} == {"warm"}
    # Tune handed each kept trial process to the next trial: none was ended before it started
    assert not [e for e in records if e.cause == "not_started"]
    spend = json.loads((run_dir / "spend.json").read_text())
    assert spend["total"] == pytest.approx(sum(e.device_seconds for e in records))
    assert "winner" in result.stdout and str(run_dir) in result.stdout
    # steps.jsonl is the record: Tune's loggers write no copies (TensorBoard's fsync each result)
    assert not [p.name for p in (run_dir / "ray").rglob("*") if p.name.startswith(("events.out", "progress.csv", "result.json"))]
    assert "Failed to fetch metrics" not in result.stdout + result.stderr


def test_ep2_trial_runs_on_two_gloo_ranks_with_evidence(campaign_run) -> None:
    run_dir, _ = campaign_run
    (ep2,) = [e for e in entries(run_dir) if e.stage == "screen" and e.warm_start == "fast-ep2"]
    assert ep2.outcome == "ok", ep2.reason
    assert ep2.evidence.ep_group_size == 2
    assert ep2.evidence.local_experts_per_moe_layer == TEST_MODEL["num_moe_experts"] // 2
    assert ep2.contract.hardware.world_size == 2 and ep2.contract.shapes.expert_parallel == 2


def test_a_clearly_worse_config_is_pruned_with_its_partial_estimate(small_table, ray_local, tmp_path) -> None:
    """On a replayed table (the same steps every run): the slow warm start screened after the fast
    one, at under half its speed, is stopped two steps after its warm-up, before a steady window."""
    from dataclasses import replace
    from io import StringIO

    from rich.console import Console

    from autotune.campaign import load_campaign
    from autotune.engine.driver import run_campaign
    from autotune.engine.live import LiveView
    from autotune.engine.rundir import create_run_dir

    space = REPLAY_SPACE | {"warm_start": [
        {"name": "fast", "config": {"micro_batch_size": 4, "freeze_vision_model": True}},
        {"name": "slow", "config": {"micro_batch_size": 1}},
    ]}
    (tmp_path / "prune").mkdir()
    campaign = replace(load_campaign(campaign_file(tmp_path / "prune", max_trials=2, space=space)),
                       replay_table=small_table)
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, run_dir, view)
    screens = {e.warm_start: e for e in run_dir.trials.read() if e.stage == "screen"}
    fast, slow = screens["fast"], screens["slow"]
    assert fast.outcome == "ok" and slow.outcome == "pruned", slow.reason
    assert slow.steps == campaign.spec.stages.warmup_steps + 2 and slow.estimate.window == 2
    assert slow.estimate.mean < fast.estimate.ci_low * (1 - campaign.spec.stages.prune_margin) / 2
    assert "under half" in slow.reason and slow.objective == slow.estimate.mean
    steps = [s for s in run_dir.steps.read() if s.trial_id == slow.trial_id]
    assert [s.record.step for s in steps] == list(range(slow.steps))  # every step it ran, recorded


def test_an_early_promotion_runs_while_screening_goes_on_and_is_not_run_again(small_table, ray_local,
                                                                               tmp_path) -> None:
    """With ``stages.promote_early`` the best screen is promoted once a later screen has failed to
    beat it, before the next screen starts; bring-up waits for the promotion stage, which runs only
    what is left."""
    from dataclasses import replace
    from io import StringIO

    from rich.console import Console

    from autotune.campaign import load_campaign
    from autotune.engine.driver import run_campaign
    from autotune.engine.live import LiveView
    from autotune.engine.rundir import create_run_dir

    space = REPLAY_SPACE | {"warm_start": [
        {"name": "bring-up", "config": {"micro_batch_size": 1}},
        {"name": "fast", "config": {"micro_batch_size": 4, "freeze_vision_model": True}},
    ]}
    (tmp_path / "early").mkdir()
    campaign = load_campaign(campaign_file(tmp_path / "early", max_trials=4, space=space))
    stages = campaign.spec.stages.model_copy(update={"promote_early": True})
    campaign = replace(campaign, spec=campaign.spec.model_copy(update={"stages": stages}), replay_table=small_table)
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        outcome = run_campaign(campaign, run_dir, view)
    launched = [e for e in run_dir.trials.read() if e.launched]
    order = [(e.stage, e.warm_start or e.origin) for e in launched]
    fast = next(e for e in launched if e.warm_start == "fast")
    promotions = [e for e in launched if e.stage == "promote"]
    # fast is promoted once a screen after it has not beaten it, and screening goes on
    assert order[:2] == [("screen", "bring-up"), ("screen", "fast")] and order[2][0] == "screen", order
    assert order[3] == ("promote", "promotion") and [stage for stage, _ in order[4:]].count("screen") == 1, order
    assert promotions[0].promoted_from == fast.trial_id and promotions[0].steps == campaign.spec.stages.promote_steps
    assert [e.config for e in promotions].count(fast.config) == 1  # the promotion stage did not run it again
    assert promotions[-1].config.micro_batch_size == 1  # bring-up, last, as its baseline
    assert outcome.verdict.winner is not None and outcome.verdict.winner.config == fast.config


def test_a_trial_the_budget_stops_is_recorded_with_its_steps_and_device_seconds(small_table, ray_local,
                                                                                 tmp_path) -> None:
    """Tune ends a running trial without telling the searcher when the budget stops the stage (seen
    on the H200: a screen stopped at step 4 was in steps.jsonl, not in trials.jsonl nor the spend)."""
    from dataclasses import replace
    from io import StringIO

    from rich.console import Console

    from autotune.campaign import load_campaign
    from autotune.engine.driver import run_campaign
    from autotune.engine.live import LiveView
    from autotune.engine.rundir import create_run_dir

    space = REPLAY_SPACE | {"warm_start": [{"name": "first", "config": {"micro_batch_size": 4}}]}
    (tmp_path / "budget").mkdir()
    campaign = load_campaign(campaign_file(tmp_path / "budget", max_trials=3, space=space))
    budget = campaign.spec.budget.model_copy(update={"gpu_hours": 0.01})  # 36 device-s: the first burst's start-up
    campaign = replace(campaign, spec=campaign.spec.model_copy(update={"budget": budget}), replay_table=small_table)
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, run_dir, view)
    screens = [e for e in run_dir.trials.read() if e.stage == "screen" and e.launched]
    assert len(screens) == 1
    stopped = screens[0]
    assert (stopped.outcome, stopped.cause) == ("pruned", "budget") and 0 < stopped.steps < 16
    steps = [s for s in run_dir.steps.read() if s.trial_id == stopped.trial_id]
    assert len(steps) == stopped.steps and stopped.device_seconds >= 0.01 * 3600
    spend = json.loads((run_dir.path / "spend.json").read_text())
    assert spend["by_stage"]["screen"] == pytest.approx(stopped.device_seconds)


def test_repeated_promotion_runs_each_config_in_fresh_processes_and_reports_their_spread(small_table, ray_local,
                                                                                         tmp_path) -> None:
    """A replay draws the same steps for every run of a config (its draw is seeded by the config),
    so the processes agree exactly: the wiring is what this checks, the statistics are unit-tested."""
    from dataclasses import replace
    from io import StringIO

    import yaml
    from rich.console import Console

    from autotune.campaign import load_campaign
    from autotune.cli.report_cmd import print_summary
    from autotune.engine.driver import run_campaign
    from autotune.engine.live import LiveView
    from autotune.engine.rundir import create_run_dir
    from autotune.report.analysis import load_report

    space = REPLAY_SPACE | {"warm_start": [{"name": "fast", "config": {"micro_batch_size": 4, "freeze_vision_model": True}},
                                           {"name": "bring-up", "config": {"micro_batch_size": 1}}]}
    (tmp_path / "repeats").mkdir()
    campaign = load_campaign(campaign_file(tmp_path / "repeats", max_trials=2, space=space))
    stages = campaign.spec.stages.model_copy(update={"promote_repeats": 2})
    campaign = replace(campaign, spec=campaign.spec.model_copy(update={"stages": stages}), replay_table=small_table)
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, run_dir, view)
    promoted = [e for e in run_dir.trials.read() if e.stage == "promote"]
    assert [e.config.micro_batch_size for e in promoted] == [4, 1, 4, 1]  # round by round
    report = load_report(run_dir.path)
    assert [(row.config.micro_batch_size, row.processes) for row in report.board.rows] == [(4, 2), (1, 2)]
    assert report.verdict.spread.relative_sd == 0.0 and report.verdict.spread.degrees_of_freedom == 2
    assert report.gain_over_bring_up().processes == 2
    winner = yaml.safe_load((run_dir.path / "winner.yaml").read_text())
    assert winner["objective"]["processes"] == 2 and winner["objective"]["process_spread"]["relative_sd"] == 0.0
    printed = StringIO()
    print_summary(Console(file=printed, width=200), report)
    assert "between fresh processes of one config, a run's mean moved ±0.0%" in printed.getvalue()
    assert "2 × 50" in printed.getvalue() and "ran in one process" not in printed.getvalue()


def test_promotion_runs_fifty_steps_and_the_verdict_reads_the_intervals(campaign_run) -> None:
    run_dir, _ = campaign_run
    promoted = [e for e in entries(run_dir) if e.stage == "promote" and e.space == "engine_test"]
    # the top 2 screens and the bring-up warm start, run as long as they are for the gain over it
    (bring_up,) = [e for e in entries(run_dir) if e.stage == "screen" and e.warm_start == "bring-up"]
    assert bring_up.config in {e.config for e in promoted}
    # its screen only showed that it runs: stopped two steps after its warm-up (1 step here)
    assert bring_up.outcome == "ok" and bring_up.steps == 1 + 2 and "its promotion measures it" in bring_up.reason
    assert len(promoted) == 3 and all(e.steps == 50 and e.outcome == "ok" for e in promoted)
    # each run's contract says where its two ranks ran; the promotion runs ran where the first did
    assert all(len(e.contract.workers) == 2 for e in entries(run_dir) if e.launched and e.steps)
    assert len({tuple(w.node_id for w in e.contract.workers) for e in promoted}) == 1
    assert all(all(e.evidence.checks.values()) for e in promoted)
    assert {e.promoted_from for e in promoted} <= {e.trial_id for e in entries(run_dir) if e.stage == "screen"}
    everything = [e for e in entries(run_dir) if e.stage == "promote"]  # both spaces: one verdict
    board = json.loads((run_dir / "leaderboard.json").read_text())
    (winner_row,) = [row for row in board["rows"] if row["winner"]]
    best = max(everything, key=lambda e: e.objective)
    assert winner_row["config"] == best.config.to_plain()
    overlap = any(e.estimate.ci_high >= best.estimate.ci_low for e in everything if e is not best)
    assert ("tied" in board["verdict"]) == overlap


def test_winner_exports_round_trip_through_the_registry(campaign_run) -> None:
    run_dir, _ = campaign_run
    config, version, rest = load_document(run_dir / "winner.yaml")
    assert rest["contract"]["config"] == config.to_plain() and rest["objective"]["steady_steps"] >= 5
    for fmt in FORMATS:
        printed = autotune("export", str(run_dir), "--format", fmt, env=os.environ | {"RAY_ADDRESS": ""}, timeout=120)
        assert printed.returncode == 0, printed.stderr
        body = "\n".join(line for line in printed.stdout.splitlines() if not line.startswith("# "))
        assert body.strip() == render(config, fmt, version, rest).strip()
    assert set(rest["tuned"]) == set(SPACE["tune"]) | set(NEXT_SPACE["tune"])
    overrides = shlex.split(render(config, "bridge", version))
    assert read_bridge_overrides(overrides) == config
    assert {o.split("=")[0] for o in overrides} <= \
        {KNOBS[name].bridge_key_for(version) for name in KNOBS} | BRIDGE_COMPANION_KEYS | {"model.cuda_graph_scope"} \
        | {"mixed_precision"}  # Bridge 0.6's precision preset
    assert read_megatron_lm_args(shlex.split(render(config, "megatron-lm", version))) == config


def test_workflow_tunes_the_next_space_when_its_projected_headroom_is_large(campaign_run) -> None:
    run_dir, result = campaign_run
    assert "engine_test_next: projected headroom" in result.stdout
    launched = [e for e in entries(run_dir) if e.launched]
    assert {(e.space, e.stage) for e in launched} == {
        ("engine_test", "screen"), ("engine_test", "promote"), ("engine_test_next", "screen"), ("engine_test_next", "promote")}
    assert all(e.model_tflops_per_s_per_gpu > 0 for e in launched if e.outcome == "ok")
    board = json.loads((run_dir / "leaderboard.json").read_text())
    assert {row["space"] for row in board["rows"]} == {"engine_test", "engine_test_next"}  # one verdict over both
    assert (run_dir / "then_space.yaml").is_file()


def test_projected_headroom_is_the_reachable_rate_over_the_promoted_best() -> None:
    promoted = [entry("a", "promote", 10.0, model_tflops_per_s_per_gpu=400.0),
                entry("b", "promote", 12.0, model_tflops_per_s_per_gpu=470.0),
                entry("c", "promote", None, outcome="oom")]
    assert projected_headroom(promoted, 440.0) == pytest.approx(440 / 470 - 1)  # the seed: 3D does not pay
    assert projected_headroom(promoted[2:], 440.0) is None


def test_an_oom_is_recorded_once_and_configs_that_need_more_memory_never_launch(tmp_path, cache_env) -> None:
    path = campaign_file(tmp_path, max_trials=3, space=OOM_SPACE, cpu_memory_cap_gib=OOM_CAP_GIB)
    result = autotune("run", str(path), env=cache_env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "no winner" in result.stdout
    records = entries(only_run_dir(tmp_path))
    ooms = [e for e in records if e.outcome == "oom"]
    assert len(ooms) == 1 and ooms[0].config.micro_batch_size == 1 and "can't allocate memory" in ooms[0].reason
    # No step to split its seconds by: the entry says where they went, to the out of memory
    parts = [part.name for part in ooms[0].out_of_memory_parts]
    out_of_memory = parts.index("the first step, until out of memory")
    assert ooms[0].steps == 0 and parts[out_of_memory + 1] == "the trainable's end (its result, release)"
    assert parts[-1] == "the ranks' start and exit" and all(part.seconds >= 0 for part in ooms[0].out_of_memory_parts)
    assert "out of memory before a step in" in autotune("report", str(only_run_dir(tmp_path)), env=cache_env).stdout
    start = ooms[0].rank_start
    page = (only_run_dir(tmp_path) / "report.html").read_text()
    assert f'data-field="rank_start:{start}:oom:the first step, until out of memory"' in page
    predicted = [e for e in records if e.outcome == "oom_predicted"]
    assert predicted and all(not e.launched and e.device_seconds == 0 and e.cause == "oom_dominance" for e in predicted)
    import optuna

    from autotune.search.proposer import journal_storage

    study = optuna.load_study(study_name="engine-test", storage=journal_storage(str(only_run_dir(tmp_path) / "study.journal")))
    told = [t for t in study.trials if t.user_attrs.get("outcome") == "oom"]
    assert len(told) == 1 and told[0].constraints == {"feasible": 1.0}


def test_resume_after_sigkill_keeps_every_finished_trial(tmp_path, cache_env) -> None:
    path = campaign_file(tmp_path, max_trials=2)
    printed = tmp_path / "driver.log"  # what the driver said, should it end before the kill
    with printed.open("w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "autotune", "run", str(path)], cwd=ROOT, env=cache_env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    run_dir = None
    while time.monotonic() < deadline:
        runs = list((tmp_path / "runs").glob("*/trials.jsonl"))
        if runs and any(e.launched for e in RunDir(runs[0].parent).trials.read()):
            run_dir = runs[0].parent
            break
        assert driver.poll() is None, f"the campaign ended before it could be killed:\n{printed.read_text()[-4000:]}"
        time.sleep(0.5)
    assert run_dir is not None, "no trial finished within 300 s"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    before = (run_dir / "trials.jsonl").read_text()
    result = autotune("resume", str(run_dir), env=cache_env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    after = (run_dir / "trials.jsonl").read_text()
    assert after.startswith(before)  # appended to, never rewritten
    records = entries(run_dir)
    screened = [e for e in records if e.launched and e.stage == "screen"]
    assert len(screened) == 2  # the budget counts the trials finished before the kill
    assert len({e.config for e in screened}) == 2  # none re-run
    assert (run_dir / "winner.yaml").is_file()


# -- the deciding parts on their own ---------------------------------------------------------------

def entry(trial_id: str, stage: str, objective: float | None, ci: float = 1.0, outcome: str = "ok",
          checks: bool = True, **fields) -> TrialEntry:
    """A finished trial's entry; ``fields`` are knobs, or entry fields where the name is one."""
    config = {k: v for k, v in fields.items() if k not in TrialEntry.model_fields}
    estimate = None if objective is None else SteadyEstimate(
        warmup_steps=3, window=20, outliers=0, mean=objective, median=objective, ci_low=objective - ci,
        ci_high=objective + ci, confidence=0.95, relative_half_width=ci / objective, converged=False)
    entry_fields = {"origin": "sampler" if stage == "screen" else "promotion"} | {
        k: v for k, v in fields.items() if k in TrialEntry.model_fields}
    return TrialEntry(trial_id=trial_id, stage=stage, space="s", number=None,
                      config=complete_config({"micro_batch_size": 1, **config}), launched=True, outcome=outcome,
                      reason="", objective=objective, estimate=estimate,
                      evidence=Evidence(checks={"recompute_granularity": checks}), device_seconds=1.0,
                      finished_at=datetime.now(timezone.utc), **entry_fields)


def test_promotion_takes_the_best_distinct_configs_within_reach_and_skips_promoted_ones() -> None:
    records = [entry("a", "screen", 10.0, micro_batch_size=1), entry("b", "screen", 30.0, micro_batch_size=2),
               entry("c", "screen", 30.5, micro_batch_size=2), entry("d", "screen", 20.0, ci=9.0, micro_batch_size=4),
               entry("e", "screen", None, outcome="oom", micro_batch_size=8)]
    chosen = promotion_candidates(records, 2, "s", margin=0.02)
    assert [(c.config.micro_batch_size, c.promoted_from, c.origin) for c in chosen] == [(2, "c", "promotion"),
                                                                                      (4, "d", "promotion")]
    records.append(entry("p", "promote", 31.0, micro_batch_size=2))
    assert [c.config.micro_batch_size for c in promotion_candidates(records, 2, "s", margin=0.02)] == [4]
    assert promotion_candidates(records, 2, "another space", margin=0.02) == []
    # d's screen (20 +- 5) cannot reach the best's lower bound (29.5) less 2 %: no long run confirms it
    records[3] = entry("d", "screen", 20.0, ci=5.0, micro_batch_size=4)
    assert [c.config.micro_batch_size for c in promotion_candidates(records[:-1], 3, "s", margin=0.02)] == [2]
    # the bring-up warm start runs as long as the promoted configs, pruned or not, but only once
    records.append(entry("u", "screen", 3.0, outcome="pruned", micro_batch_size=1, recompute_granularity="full",
                         origin="warm_start", warm_start="bring-up"))
    chosen = promotion_candidates(records[:-2] + records[-1:], 2, "s", margin=0.02)
    assert [(c.config.micro_batch_size, c.promoted_from) for c in chosen] == [(2, "c"), (1, "u")]
    records.append(entry("pu", "promote", 3.1, micro_batch_size=1, recompute_granularity="full"))
    assert [c.promoted_from for c in promotion_candidates(records, 2, "s", margin=0.02)] == []


def test_early_promotion_takes_the_best_once_a_later_screen_failed_to_beat_it_and_never_bring_up() -> None:
    bring_up = entry("u", "screen", 3.0, micro_batch_size=1, recompute_granularity="full", origin="warm_start",
                     warm_start="bring-up")
    slower = entry("x", "screen", 2.0, micro_batch_size=1, recompute_granularity="selective")
    assert early_promotion([bring_up, slower], "s", margin=0.02) is None  # the baseline waits for the promotion stage
    records = [bring_up, entry("a", "screen", 10.0, micro_batch_size=2)]
    assert early_promotion(records, "s", margin=0.02) is None  # the newest screen: the next may beat it
    records.append(entry("o", "screen", None, outcome="oom", micro_batch_size=8))
    launch = early_promotion(records, "s", margin=0.02)
    assert (launch.stage, launch.config.micro_batch_size, launch.promoted_from) == ("promote", 2, "a")
    assert early_promotion(records, "another space", margin=0.02) is None
    records.append(entry("pa", "promote", 10.5, micro_batch_size=2))
    assert early_promotion(records, "s", margin=0.02) is None  # promoted already
    records += [entry("b", "screen", 10.1, micro_batch_size=4), slower]
    assert early_promotion(records, "s", margin=0.02) is None  # within 2 % of a's screen: nothing to gain
    records += [entry("c", "screen", 10.3, micro_batch_size=8, recompute_granularity="full"), slower]
    assert early_promotion(records, "s", margin=0.02).promoted_from == "c"
    # a promotion that lost its node did not measure: the config is promoted again
    lost = entry("pa", "promote", None, outcome="failed", micro_batch_size=2, cause="node_lost")
    assert early_promotion(records[:3] + [lost], "s", margin=0.02).promoted_from == "a"


def placed(trial_id: str, stage: str, objective: float | None, nodes: list[str], gpus: list[str | None] | None = None,
           replayed_from: str | None = None, **fields) -> TrialEntry:
    """An entry whose ranks ran on ``nodes`` (and ``gpus``), as its contract says; a replay of
    ``replayed_from`` where given."""
    workers = tuple(WorkerPlacement(node_id=node, nvlink_domain=None, accelerator_id=gpu)
                    for node, gpu in zip(nodes, gpus or [None] * len(nodes)))
    contract = Contract(trainable="replay" if replayed_from else "native", replayed_from=replayed_from, workers=workers)
    return entry(trial_id, stage, objective, contract=contract, steps=50, **fields)


def test_promotion_runs_go_where_the_first_went_and_the_verdict_says_when_runs_ran_apart() -> None:
    def alive() -> set[str]:
        return {"n1", "n2", "n3", "n4"}

    def never() -> set[str]:
        raise AssertionError("the cluster is asked only once a promotion run said where it ran")

    screen = placed("a", "screen", 10.0, ["n2", "n3"], micro_batch_size=2)
    lost = entry("p0", "promote", None, outcome="failed", micro_batch_size=2, cause="node_lost")  # never said where
    assert promotion_nodes([screen, lost], 2, never) is None  # a screen sets nothing
    first = placed("p1", "promote", 10.0, ["n1", "n1"], micro_batch_size=2)
    later = placed("p2", "promote", 5.0, ["n4", "n4"], micro_batch_size=4)
    assert promotion_nodes([screen, lost, first, later], 2, alive) == ("n1", "n1")
    assert promotion_nodes([screen, lost, first, later], 2, lambda: alive() - {"n1"}) == ("n4", "n4")  # n1 lost
    assert promotion_nodes([screen, first], 4, never) is None  # a space of another world size

    together = decide([first, placed("p3", "promote", 5.0, ["n1", "n1"], micro_batch_size=4)])
    assert together.placements == 1 and "machines" not in together.summary
    apart = decide([first, later])
    assert apart.placements == 2 and together.winner.trial_id == apart.winner.trial_id == "p1"
    assert apart.summary.endswith("its runs ran on 2 different sets of nodes and devices, so the machines' "
                                  "differences are in its gaps")
    # one node, other GPUs: other devices
    assert decide([placed("g0", "promote", 10.0, ["n1"], ["0"], micro_batch_size=2),
                   placed("g1", "promote", 5.0, ["n1"], ["1"], micro_batch_size=4)]).placements == 2
    # a replay ran here what was measured elsewhere: nothing to say
    assert decide([placed("r0", "promote", 10.0, ["n1"], replayed_from="t.jsonl", micro_batch_size=2),
                   placed("r1", "promote", 5.0, ["n2"], replayed_from="t.jsonl", micro_batch_size=4)]).placements is None


def test_gain_over_bring_up_is_quoted_between_runs_of_equal_length_with_its_interval() -> None:
    winner = entry("w", "promote", 30.0, ci=1.0, micro_batch_size=4)
    base = entry("b", "promote", 10.0, ci=0.5, micro_batch_size=1)
    gain = gain_at_equal_fidelity(winner, base)
    assert gain.value == pytest.approx(2.0) and not gain.tie
    assert (gain.low, gain.high) == (pytest.approx(29.0 / 10.5 - 1), pytest.approx(31.0 / 9.5 - 1))
    close = gain_at_equal_fidelity(entry("w", "promote", 10.4, ci=1.0), base)
    assert close.tie and "a tie" in close.describe()
    short = entry("s", "screen", 10.0, ci=0.5, micro_batch_size=1).model_copy(update={"steps": 8})
    assert gain_at_equal_fidelity(winner, short) is None  # never a long run over a short screen


def test_repeated_promotion_runs_in_rounds_and_a_resumed_campaign_runs_the_rest() -> None:
    records = [entry("a", "screen", 30.0, micro_batch_size=2), entry("b", "screen", 29.0, micro_batch_size=4),
               entry("u", "screen", 3.0, micro_batch_size=1, origin="warm_start", warm_start="bring-up")]
    chosen = promotion_candidates(records, 2, "s", margin=0.02, repeats=3)
    assert [c.config.micro_batch_size for c in chosen] == [2, 4, 1] * 3
    records += [entry("p1", "promote", 31.0, micro_batch_size=2), entry("p2", "promote", 28.0, micro_batch_size=4),
                entry("lost", "promote", None, outcome="failed", micro_batch_size=1, cause="node_lost")]
    assert [c.config.micro_batch_size for c in promotion_candidates(records, 2, "s", margin=0.02, repeats=3)] == \
        [1, 2, 4, 1, 2, 4, 1]


def test_a_promotion_run_that_does_not_finish_ok_drops_its_configs_later_runs() -> None:
    from autotune.engine.records import Launch
    from autotune.engine.tune_roles import ListSearcher

    class Ledger:
        """What the searcher asks of the ledger: a trial starts, and ends as its entry says; the
        entries so far (where promotion runs went: these said nowhere)."""

        def __init__(self) -> None:
            self.ends: dict[str, TrialEntry] = {}
            self.entries: list[TrialEntry] = []

        def start(self, trial_id: str, launch: Launch) -> None:
            self.ends[trial_id] = entry(trial_id, "promote", 10.0 if launch.config.micro_batch_size == 1 else None,
                                        outcome="ok" if launch.config.micro_batch_size == 1 else "oom",
                                        micro_batch_size=launch.config.micro_batch_size)

        def finish(self, trial_id: str, errored: bool = False) -> TrialEntry:
            return self.ends[trial_id]

    chosen = promotion_candidates([entry("a", "screen", 30.0, micro_batch_size=8),
                                   entry("b", "screen", 29.0, micro_batch_size=1)], 2, "s", 0.02, repeats=3)
    searcher = ListSearcher(chosen, Ledger(), steps=50)
    ran = []
    while isinstance(config := searcher.suggest(f"t{len(ran)}"), dict):
        ran.append(config["config"]["micro_batch_size"])
        searcher.on_trial_complete(f"t{len(ran) - 1}")
    assert ran == [8, 1, 1, 1]  # MBS 8 ran out of memory in its first process: its other two never start


def test_a_verdict_over_fresh_processes_is_bounded_by_how_far_they_moved() -> None:
    from scipy.stats import t

    from autotune.engine.promotion import leaderboard

    def run(trial_id: str, objective: float | None, **fields) -> TrialEntry:
        return entry(trial_id, "promote", objective, steps=50, **fields)

    # Each run pins its own mean to +-1, but A's two processes landed 20 apart and B's 10 apart.
    runs = [run("a1", 110.0, micro_batch_size=4), run("b1", 90.0, micro_batch_size=2),
            run("a2", 90.0, micro_batch_size=4), run("b2", 80.0, micro_batch_size=2), run("u1", 40.0), run("u2", 40.0)]
    verdict = decide(runs)
    a, b, u = verdict.promoted
    assert [e.runs for e in verdict.promoted] == [("a1", "a2"), ("b1", "b2"), ("u1", "u2")]
    sd = ((2 * 0.1 ** 2 + 2 * (5 / 85) ** 2) / 3) ** 0.5
    assert verdict.spread.degrees_of_freedom == 3 and verdict.spread.relative_sd == pytest.approx(sd)
    assert a.objective == 100.0 and a.estimate.ci_high - a.objective == pytest.approx(t.ppf(0.975, 3) * sd * 100 / 2 ** 0.5)
    # one run each, B would have lost beyond the intervals; over processes it is a tie
    assert verdict.winner.config == a.config and [e.config for e in verdict.tied] == [b.config]
    assert not decide([runs[0], runs[1]]).tied
    gain = gain_at_equal_fidelity(a, u)
    assert gain.processes == 2 and "2 fresh-process 50-step runs of each" in gain.describe()
    assert gain.low == pytest.approx(a.estimate.ci_low / u.estimate.ci_high - 1)
    board = leaderboard(runs, verdict)
    assert [(row.trial_id, row.processes, row.objective) for row in board.rows] == \
        [(a.trial_id, 2, 100.0), (b.trial_id, 2, 85.0), (u.trial_id, 2, 40.0)]
    # a config that ran out of memory in one of its processes cannot win
    verdict = decide([*runs[:2], run("a2", None, outcome="oom", micro_batch_size=4), *runs[3:]])
    assert verdict.winner.config == b.config and [e.trial_id for e, _ in verdict.disqualified] == ["a2"]


def test_verdict_ties_overlapping_intervals_and_rules_out_contradicted_evidence() -> None:
    clear = decide([entry("a", "promote", 100.0, micro_batch_size=1), entry("b", "promote", 90.0, micro_batch_size=2)])
    assert clear.winner.trial_id == "a" and not clear.tied and "beyond their intervals" in clear.summary
    tied = decide([entry("a", "promote", 100.0, ci=6.0), entry("b", "promote", 90.0, ci=6.0, micro_batch_size=2)])
    assert tied.winner.trial_id == "a" and [e.trial_id for e in tied.tied] == ["b"]
    lying = entry("a", "promote", 100.0, checks=False)
    mock = entry("m", "promote", 500.0, micro_batch_size=4, benchmark_only=True)
    verdict = decide([lying, mock, entry("b", "promote", 90.0, micro_batch_size=2)])
    assert verdict.winner.trial_id == "b"
    assert {e.trial_id for e, _ in verdict.disqualified} == {"a", "m"}


def test_ray_train_launcher_runs_an_ep2_burst_on_a_two_worker_group(tmp_path, photo_shards) -> None:
    """The multi-node launcher: a Tune trial whose burst runs on a TorchTrainer group of two gloo workers."""
    import ray
    from ray import tune

    from autotune.core.contract import BurstRequest, DataSpec
    from autotune.core.model import model_preset
    from autotune.engine.trial import EndEvent, StepEvent, TrialJob, read_result, run_trial

    request = BurstRequest(config=complete_config({}), model=model_preset("cpu_tiny_moe_vlm", TEST_MODEL),
                           data=DataSpec(str(photo_shards)), steps=3, world_size=2, data_workers=0)
    job = TrialJob(trainable="native", request=request, launcher="ray_train", objective="useful_tokens_per_s_per_gpu",
                   use_gpu=False, storage_path=str(tmp_path / "train"), data_source="shards")
    config = complete_config({"expert_model_parallel_size": 2, "micro_batch_size": 2, "moe_token_dispatcher_type": "alltoall"})
    cluster = multi_node_cluster(num_cpus=2)  # Ray Train's placement-group cleaner needs its dashboard
    join_cluster(cluster.address)
    try:
        results = tune.Tuner(
            tune.with_resources(tune.with_parameters(run_trial, job=job), job.trial_resources()),
            param_space={"config": config.to_plain(), "steps": 3, "new_rank_processes": False},
            run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0),
        ).fit()
    finally:
        ray.shutdown()
        cluster.shutdown()
    history = results[0].metrics_dataframe
    events = [read_result(row) for row in history.to_dict("records")]
    steps = [event for event in events if isinstance(event, StepEvent)]
    (end,) = [event for event in events if isinstance(event, EndEvent)]
    assert end.outcome == "ok", end.error
    assert len(steps) == 3 and steps[0].contract.hardware.world_size == 2
    assert [r.step for r in (event.record for event in steps)] == [0, 1, 2]
    assert {worker.node_id for worker in steps[0].contract.workers} and len(steps[0].contract.workers) == 2
    assert end.evidence.ep_group_size == 2 and end.evidence.checks["expert_model_parallel_size"]


class _Screens:
    """The part of the ledger a budget reads: the launched screens of a space, in finishing order."""

    def __init__(self, records: list[TrialEntry]) -> None:
        self.records, self.live = records, {}

    def launched(self, stage: str, space: str | None = None) -> list[TrialEntry]:
        return [e for e in self.records if e.stage == stage and space in (None, e.space)]


def test_patience_ends_screening_after_that_many_screens_in_a_row_find_nothing_faster(tmp_path) -> None:
    from dataclasses import replace

    from autotune.campaign import load_campaign
    from autotune.engine.tune_roles import Budget

    campaign = load_campaign(campaign_file(tmp_path, max_trials=20))
    spec = campaign.spec.model_copy(update={"budget": campaign.spec.budget.model_copy(update={"patience": 3})})
    campaign = replace(campaign, spec=spec)
    records = [entry("a", "screen", 10.0), entry("b", "screen", 30.0, micro_batch_size=2),
               entry("c", "screen", None, outcome="oom", micro_batch_size=4),
               entry("d", "screen", 25.0, outcome="pruned", micro_batch_size=8)]
    budget = Budget(campaign, _Screens(records), "s")
    assert budget.plateaued() is None  # two screens since the best
    records.append(entry("e", "screen", 29.0, recompute_granularity="full"))  # slower: the third
    assert budget.plateaued() == "3 screens in a row found nothing faster than the best (patience 3)"
    records[-1] = entry("e", "screen", 31.0, recompute_granularity="full")  # faster: the count starts again
    assert budget.plateaued() is None
    lost = entry("f", "screen", None, outcome="failed", micro_batch_size=2, cause="node_lost")
    records.extend([lost, lost, lost])  # the cluster failed, not the search: not counted
    assert budget.plateaued() is None
    # Only the sampler's proposals count: a warm start runs whatever the search finds (bring-up, in
    # the other slot, ends after two proposals that did not beat the best), and the frontier walk's
    # levels end by the walk's own rule; the third of the sampler's is what ends screening.
    records.extend([entry("g", "screen", 20.0, micro_batch_size=2, recompute_granularity="full"),
                    entry("h", "screen", 21.0, micro_batch_size=4, recompute_granularity="full", origin="nearest"),
                    entry("u", "screen", 3.0, micro_batch_size=1, recompute_granularity="full", origin="warm_start",
                          warm_start="bring-up"),
                    entry("w", "screen", 27.0, micro_batch_size=4, origin="frontier")])
    assert budget.plateaued() is None
    records.append(entry("i", "screen", 22.0, micro_batch_size=8, recompute_granularity="full"))
    assert budget.plateaued() == "3 screens in a row found nothing faster than the best (patience 3)"


def test_the_ledger_keeps_the_best_screen_and_the_spend_as_entries_arrive(tmp_path) -> None:
    """The scheduler asks for the best screen at every step and the stopper for the spend on every
    loop: both are kept as entries arrive, read back on resume and added to by later entries."""
    from autotune.engine.ledger import Ledger
    from autotune.search.history import Proposal, Rejection

    run_dir = RunDir(tmp_path)
    records = [entry("a", "screen", 10.0), entry("b", "screen", 30.0, micro_batch_size=2),
               entry("c", "promote", 50.0, micro_batch_size=2), entry("d", "screen", 40.0, outcome="pruned"),
               entry("e", "screen", 30.0, micro_batch_size=4), entry("f", "screen", None, outcome="oom")]
    for seconds, record in enumerate(records, start=1):
        run_dir.trials.append(record.model_copy(update={"device_seconds": float(seconds)}))
    ledger = Ledger(run_dir, world_size=2, warmup_steps=1, target_relative_half_width=0.02, benchmark_only=False)
    assert ledger.best_entry().trial_id == "b"  # screens that ran only; the first of equals
    assert ledger.device_seconds() == 21.0
    proposal = Proposal(7, complete_config({"micro_batch_size": 8}), "frontier")
    ledger.reject(Rejection(proposal, "invalid", "rules", "a rule"), "s")
    assert ledger.device_seconds() == 21.0 and len(ledger.entries) == 7
    assert ledger.entries[-1].origin == "frontier" and ledger.entries[-1].cause == "rules"
    assert Ledger(run_dir, world_size=2, warmup_steps=1, target_relative_half_width=0.02,
                  benchmark_only=False).best_entry() == ledger.best_entry()


def test_promotion_runs_pinned_to_a_lost_node_that_have_not_begun_end_node_lost_and_run_again(tmp_path: Path,
                                                                                                monkeypatch) -> None:
    """Runs pinned to a node gone from the cluster: one still pending (Ray would wait for ever) and
    one running without a step (a Ray Train worker group waiting for its node) end ``node_lost``,
    the pending one charged nothing, and each runs once more; a run with a step in, or pinned to
    live nodes, is left alone; Ray is asked at most once every few seconds."""
    from ray.tune.experiment import Trial
    from ray.tune.search import ConcurrencyLimiter

    from autotune.engine import tune_roles
    from autotune.engine.ledger import Ledger

    ledger = Ledger(RunDir(tmp_path), world_size=1, warmup_steps=1, target_relative_half_width=0.02,
                    benchmark_only=False)
    chosen = promotion_candidates([entry(name, "screen", 30.0 - i, micro_batch_size=m)
                                   for i, (name, m) in enumerate([("a", 1), ("b", 2), ("c", 4), ("d", 8)])],
                                  4, "s", 0.5)
    searcher = tune_roles.ListSearcher(chosen, ledger, steps=50)
    limiter = ConcurrencyLimiter(searcher, max_concurrent=4)
    asks = []
    monkeypatch.setattr(tune_roles.ray, "nodes", lambda: asks.append(1) or [{"NodeID": "n1", "Alive": True},
                                                                            {"NodeID": "n2", "Alive": False}])

    class Run:  # what the scheduler reads of Tune's trial
        def __init__(self, trial_id: str, status: str, nodes: list[str]) -> None:
            self.trial_id, self.status, self.config = trial_id, status, {"nodes": nodes}

        def init_local_path(self) -> None:
            pass

    class Controller:  # Tune's, as a scheduler sees it: stopping a trial tells the search algorithm
        def __init__(self, runs: list[Run]) -> None:
            self.runs, self.stopped = runs, []

        def get_trials(self) -> list[Run]:
            return self.runs

        def stop_trial(self, run: Run) -> None:
            self.stopped.append(run.trial_id)
            limiter.on_trial_complete(run.trial_id)

    for trial_id in ("pending", "building", "stepping", "alive"):
        assert limiter.suggest(trial_id) is not None
    ledger.live["stepping"].last_report = time.monotonic()
    controller = Controller([Run("pending", Trial.PENDING, ["n2"]), Run("building", Trial.RUNNING, ["n2"]),
                             Run("stepping", Trial.RUNNING, ["n2"]), Run("alive", Trial.PENDING, ["n1"])])
    scheduler = tune_roles.PinnedRunScheduler(ledger)
    scheduler.choose_trial_to_run(controller)
    assert controller.stopped == ["pending", "building"] and len(asks) == 1
    ended = {e.trial_id: e for e in ledger.entries}
    assert {e.cause for e in ended.values()} == {"node_lost"} and "n2" in ended["pending"].reason
    assert ended["pending"].device_seconds == 0.0 < ended["building"].device_seconds
    retries = [limiter.suggest(f"again{i}") for i in range(2)]  # their slots came back: each runs once more
    assert sorted(ledger.live[f"again{i}"].launch.retry_of for i in range(2)) == ["building", "pending"]
    assert all(retry["nodes"] is None for retry in retries)  # no promotion run has said where it ran yet
    controller.runs.append(Run("again0", Trial.PENDING, ["n2"]))
    scheduler.choose_trial_to_run(controller)  # within the period: Ray is not asked again
    assert len(asks) == 1 and controller.stopped == ["pending", "building"]


def test_a_trial_tune_ends_before_it_starts_is_told_to_the_searcher_and_runs_once_more(tmp_path) -> None:
    """With actor reuse, Tune marks a trial ERROR without a word to the searcher when the process it
    would reuse is still busy (Ray 2.60's ``_on_trial_reset``); the searcher would wait for it
    forever. The guard records it ``not_started``, frees its slot, and the config runs again."""
    from ray.tune.experiment import Trial
    from ray.tune.search import ConcurrencyLimiter

    from autotune.engine.ledger import Ledger
    from autotune.engine.tune_roles import ListSearcher, NotStartedGuard

    ledger = Ledger(RunDir(tmp_path), world_size=2, warmup_steps=1, target_relative_half_width=0.02,
                    benchmark_only=False)
    chosen = promotion_candidates([entry("a", "screen", 30.0, micro_batch_size=8)], 1, "s", 0.02)
    searcher = ListSearcher(chosen, ledger, steps=50)
    limiter = ConcurrencyLimiter(searcher, max_concurrent=1)
    first = limiter.suggest("t0")
    assert limiter.suggest("t1") is None  # the one slot is taken

    class Errored:  # what the guard reads of Tune's trial
        trial_id, status = "t0", Trial.ERROR

    guard = NotStartedGuard(searcher, limiter)
    guard.on_step_end(0, [Errored()])
    (lost,) = ledger.entries
    assert lost.outcome == "failed" and lost.cause == "not_started"
    again = limiter.suggest("t1")  # the slot came back, and the config runs again
    assert again["config"] == first["config"]
    assert ledger.live["t1"].launch.retry_of == "t0"
    guard.on_step_end(1, [Errored()])  # told once
    assert len(ledger.entries) == 1
