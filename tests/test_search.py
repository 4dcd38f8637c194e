"""The Optuna search over a space: conditional parameters, rules and OOMs as zero-cost feedback,
warm starts first, resume from the journal file; the screening stop/prune decision."""

from __future__ import annotations

import os
import random
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.core.knobs import complete_config
from autotune.core.steady import steady_state
from autotune.rules import violations
from autotune.search.encoding import config_params, suggest_config
from autotune.search.memory import needs_at_least_as_much_memory
from autotune.search.proposer import Proposer
from autotune.search.screening import screen
from autotune.space import load_space, target_context

CPU_DEMO = load_space(Path("search_spaces/cpu_demo.yaml"))
H200 = load_space(Path("search_spaces/h200_single.yaml"))
PARALLEL_3D = load_space(Path("search_spaces/parallel_3d.yaml"))  # tunes the graph scope


def fake_value(config) -> float:
    """A deterministic stand-in objective (the search logic is under test, not the model)."""
    return 100.0 * config.micro_batch_size + (50.0 if config.freeze_vision_model else 0.0)


@pytest.mark.parametrize("space", [CPU_DEMO, H200, PARALLEL_3D], ids=["cpu_demo", "h200_single", "parallel_3d"])
def test_suggested_configs_are_the_space_and_parameters_follow_conditions(space) -> None:
    proposer = Proposer(space, target_context(space), None, "t", sampler="random")
    grid = set(space.configs())
    for _ in range(60):
        trial = proposer.study.ask()
        config = suggest_config(trial, space)
        assert config in grid
        assert ("recompute_modules" in trial.params) == (config.recompute_granularity == "selective")
        graphs = config.cuda_graph_impl in ("local", "transformer_engine")
        assert ("cuda_graph_scope" in trial.params) == ("cuda_graph_scope" in space.tuned and graphs)
        proposer.study.tell(trial, 0.0)


def test_config_params_round_trip_through_enqueue() -> None:
    proposer = Proposer(H200, target_context(H200), None, "t", sampler="random")
    configs = random.Random(0).sample(list(H200.configs()), 8)
    for config in configs:
        proposer.study.enqueue_trial(config_params(config, H200))
    for config in configs:
        trial = proposer.study.ask()
        assert suggest_config(trial, H200) == config
        proposer.study.tell(trial, 0.0)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_rule_rejected_configs_never_reach_a_device_but_are_told(sampler: str) -> None:
    context = target_context(CPU_DEMO)
    proposer = Proposer(CPU_DEMO, context, None, "t", sampler=sampler, seed=1)
    launched = []
    for _ in range(25):
        proposal = proposer.propose()
        assert proposal is not None
        assert violations(proposal.config, context) == []
        launched.append(proposal.config)
        proposer.complete(proposal, "ok", fake_value(proposal.config), cost_seconds=1.0)
    told = proposer.study.get_trials(deepcopy=False)
    invalid = [t for t in told if t.user_attrs.get("outcome") == "invalid"]
    assert invalid, "the sampler proposed FSDP2 with EP=2 at least once and was told"
    assert all(t.constraints == {"feasible": 1.0} and t.user_attrs["cost_seconds"] == 0.0 for t in invalid)
    assert all("torch_fsdp2_needs_pp1_ep1" in t.user_attrs["reason"] and t.user_attrs["gate"] == "rules"
               for t in invalid)
    assert len(set(launched)) == len(launched), "no config runs twice"


def test_repeats_are_not_results_and_a_converged_sampler_steps_to_the_nearest_untried_config() -> None:
    from optuna.trial import TrialState

    proposer = Proposer(CPU_DEMO, target_context(CPU_DEMO), None, "t", sampler="tpe", seed=0, startup_trials=2)
    launched = []
    for _ in range(40):
        proposal = proposer.propose()
        assert proposal is not None
        launched.append(proposal.config)
        proposer.complete(proposal, "ok", fake_value(proposal.config))
    assert len(set(launched)) == len(launched)
    trials = proposer.study.get_trials(deepcopy=False)
    repeats = [t for t in trials if "repeat_of" in t.user_attrs]
    assert repeats and all(t.state == TrialState.FAIL and "config" not in t.user_attrs for t in repeats)
    assert all(trials[t.user_attrs["repeat_of"]].state == TrialState.COMPLETE for t in repeats)
    near = [t for t in trials if t.user_attrs.get("origin") == "nearest"]
    assert near, "TPE converged on this smooth objective and repeated itself"
    for trial in near:  # queued after the sampler repeated a config: one knob or more away from it
        last_repeat = next(t for t in reversed(trials[:trial.number]) if "repeat_of" in t.user_attrs)
        repeated = trials[last_repeat.user_attrs["repeat_of"]]
        config, anchor = complete_config(trial.user_attrs["config"]), complete_config(repeated.user_attrs["config"])
        assert config != anchor and sum(config[k] != anchor[k] for k in CPU_DEMO.tuned) >= 1
    rejected = [t for t in trials if t.user_attrs.get("outcome") in ("invalid", "oom_predicted")]
    assert len(trials) <= 2 * len(launched) + len(rejected)  # a repeat, then an untried config: asks stay bounded


def test_warm_starts_come_first() -> None:
    proposer = Proposer(CPU_DEMO, target_context(CPU_DEMO), None, "t", sampler="tpe")
    proposer.enqueue_warm_starts()
    proposer.enqueue_warm_starts()  # idempotent
    first = [proposer.propose() for _ in range(2)]
    assert [(p.origin, p.warm_start) for p in first] == [("warm_start", "bring-up"), ("warm_start", "fsdp-first")]
    assert [p.config for p in first] == [w.config for w in CPU_DEMO.warm_starts]


def test_an_oom_is_told_once_and_configs_needing_more_memory_are_skipped() -> None:
    proposer = Proposer(H200, target_context(H200), None, "t", sampler="random", seed=3)
    oom_config = None
    for _ in range(80):
        proposal = proposer.propose()
        if proposal is None:
            break
        config = proposal.config
        if oom_config is None and config.micro_batch_size == 4 and config.recompute_granularity == "none":
            oom_config = config
            proposer.complete(proposal, "oom", None, peak_memory_bytes=30 * 2**30, cost_seconds=5.0)
            continue
        if oom_config is not None:
            assert not needs_at_least_as_much_memory(config, oom_config), config.describe()
        proposer.complete(proposal, "ok", fake_value(config))
    assert oom_config is not None
    trials = proposer.study.get_trials(deepcopy=False)
    # Proposed again, the OOM config is told as a repeat of its first result (``repeat_of``), never rerun.
    ooms = [t for t in trials if t.user_attrs.get("outcome") == "oom"]
    assert len(ooms) == 1 and ooms[0].constraints == {"feasible": 1.0}
    assert ooms[0].user_attrs["peak_memory_bytes"] == 30 * 2**30
    assert any(t.user_attrs.get("outcome") == "oom_predicted" for t in trials)


def test_memory_dominance() -> None:
    base = {"micro_batch_size": 2, "recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]}
    oom = complete_config(base)
    assert needs_at_least_as_much_memory(complete_config({**base, "micro_batch_size": 4}), oom)
    assert needs_at_least_as_much_memory(complete_config({**base, "recompute_modules": ["moe"]}), oom)
    assert needs_at_least_as_much_memory(complete_config({"micro_batch_size": 2}), oom)  # no recompute
    assert not needs_at_least_as_much_memory(complete_config({**base, "micro_batch_size": 1}), oom)
    assert not needs_at_least_as_much_memory(complete_config({**base, "freeze_vision_model": True}), oom)
    assert not needs_at_least_as_much_memory(complete_config({"micro_batch_size": 2, "recompute_granularity": "full"}), oom)
    assert not needs_at_least_as_much_memory(complete_config({**base, "expert_model_parallel_size": 2}), oom)
    graphed = {**base, "cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "moe_router"]}
    assert needs_at_least_as_much_memory(complete_config(graphed), oom)  # graphs only add buffers
    assert not needs_at_least_as_much_memory(complete_config(base), complete_config(graphed))
    assert not needs_at_least_as_much_memory(complete_config({**graphed, "cuda_graph_scope": ["attn"]}),
                                             complete_config(graphed))  # another scope: not compared


def test_study_resumes_from_the_journal_file(tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    context = target_context(CPU_DEMO)
    first = Proposer(CPU_DEMO, context, journal, "demo", sampler="random", seed=5)
    done = []
    for _ in range(4):
        proposal = first.propose()
        first.complete(proposal, "ok", fake_value(proposal.config))
        done.append(proposal.config)
    second = Proposer(CPU_DEMO, context, journal, "demo", sampler="random", seed=6)
    assert set(done) <= set(second.history.finished)
    for _ in range(10):
        proposal = second.propose()
        assert proposal.config not in done  # finished configs are answered from the study, not rerun
        second.complete(proposal, "ok", fake_value(proposal.config))


def test_a_journal_left_with_queued_trials_resumes_without_running_them_twice(tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    context = target_context(CPU_DEMO)
    first = Proposer(CPU_DEMO, context, journal, "demo", sampler="random", seed=5)
    for warm in CPU_DEMO.warm_starts:  # how earlier versions queued warm starts: all at once, up front
        first.study.enqueue_trial(config_params(warm.config, CPU_DEMO), user_attrs={"source": f"warm_start:{warm.name}"})
    second = Proposer(CPU_DEMO, context, journal, "demo", sampler="random", seed=5)
    assert not second.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    second.enqueue_warm_starts()
    proposals = [second.propose() for _ in range(3)]
    assert [p.warm_start for p in proposals[:2]] == [w.name for w in CPU_DEMO.warm_starts]
    assert len({p.config for p in proposals}) == 3


def test_the_journal_is_optunas_file_written_once_a_call_and_synced_when_a_trial_completes(
        tmp_path: Path, monkeypatch) -> None:
    from optuna.storages.journal import JournalFileBackend

    from autotune.search import journal as journal_module

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    writes: list[tuple[int, bool]] = []
    real_append = journal_module.append_bytes

    def counted_append(path: Path, data: bytes, *, sync: bool) -> None:
        writes.append((data.count(b"\n"), sync))
        real_append(path, data, sync=sync)

    monkeypatch.setattr(journal_module, "append_bytes", counted_append)
    journal = tmp_path / "study.journal"
    proposer = Proposer(CPU_DEMO, target_context(CPU_DEMO), journal, "demo", sampler="random", seed=5)
    writes.clear()  # the study's creation
    proposal = proposer.propose()
    (logs, sync), = writes  # the trial, its parameters and attributes: one write, not synced
    assert logs > 5 and not sync and synced == []
    proposer.complete(proposal, "ok", fake_value(proposal.config))
    assert len(writes) == 2 and writes[1][1] and len(synced) == 1
    proposer.study.tell(proposer.study.ask(), state=TrialState.FAIL)  # as a repeated proposal is told
    assert len(synced) == 1  # no result to keep
    dashboard = optuna.load_study(study_name="demo", storage=optuna.storages.JournalStorage(JournalFileBackend(str(journal))))
    trial, failed = dashboard.get_trials()  # what the dashboard reads: Optuna's own backend on the same file
    assert trial.state == TrialState.COMPLETE and trial.value == fake_value(proposal.config)
    assert complete_config(trial.user_attrs["config"]) == proposal.config
    assert failed.state == TrialState.FAIL


def test_screening_stops_converged_trials_and_prunes_clearly_worse_ones() -> None:
    rng = random.Random(0)
    best_series = [1000 * (1 + rng.gauss(0, 0.005)) for _ in range(12)]
    best = steady_state(best_series, min_warmup=2)
    assert screen(best_series, best=None, min_warmup=2).action == "stop"
    worse = [700 * (1 + rng.gauss(0, 0.005)) for _ in range(8)]
    decision = screen(worse, best=best, min_warmup=2)
    assert decision.action == "prune" and "below the best's lower bound" in decision.reason
    noisy = [1000 * (1 + rng.gauss(0, 0.2)) for _ in range(8)]
    assert screen(noisy, best=best, min_warmup=2).action == "continue"
    assert screen(worse[:3], best=best, min_warmup=2).action == "continue"  # too early to judge


def test_a_config_at_a_third_of_the_best_is_pruned_two_steps_after_its_warm_up() -> None:
    best = steady_state([1000.0, 1002.0, 998.0, 1001.0, 999.0, 1000.0, 1001.0, 999.0], min_warmup=2)
    warmup = [100.0, 250.0]
    third = [*warmup, 330.0, 340.0]
    assert screen(third[:3], best=best, min_warmup=2).action == "continue"  # one step says too little
    decision = screen(third, best=best, min_warmup=2)
    assert decision.action == "prune" and "under half" in decision.reason
    assert decision.estimate is not None and decision.estimate.window == 2 and decision.estimate.mean == 335.0
    # Not where one step after the warm-up ran over half the threshold, nor for a near-best config
    # whose first steps after the warm-up are slow: those wait for the steady window.
    assert screen([*warmup, 330.0, 510.0], best=best, min_warmup=2).action == "continue"
    assert screen([*warmup, 700.0, 720.0], best=best, min_warmup=2).action == "continue"
    # The margin moves the threshold: with prune_margin 0.7 (a noisy box's tests) 330 is not under half.
    assert screen(third, best=best, min_warmup=2, prune_margin=0.7).action == "continue"
    assert screen(third, best=None, min_warmup=2).action == "continue"  # nothing to compare with


def test_a_baselines_screen_stops_two_steps_after_its_warm_up_with_its_partial_estimate() -> None:
    series = [100.0, 250.0, 400.0, 410.0, 405.0, 400.0, 402.0, 404.0]
    assert screen(series[:3], best=None, min_warmup=2, baseline=True).action == "continue"  # one step says too little
    decision = screen(series[:4], best=None, min_warmup=2, baseline=True)
    assert decision.action == "stop" and "promotion" in decision.reason
    assert decision.estimate is not None and decision.estimate.window == 2 and decision.estimate.mean == 405.0
    assert screen(series[:4], best=None, min_warmup=2).action == "continue"  # any other config waits for its window
    # A baseline far below the best stops just the same: its promotion runs whatever its screen says,
    # so a prune would only mislabel it (a faster warm start finishing first must not decide its outcome).
    best = steady_state([1000.0, 1002.0, 998.0, 1001.0, 999.0, 1000.0, 1001.0, 999.0], min_warmup=2)
    assert screen(series[:4], best=best, min_warmup=2, baseline=True).action == "stop"
    assert screen(series[:4], best=best, min_warmup=2).action == "prune"


def test_an_exhausted_space_ends_the_search_and_each_rejection_is_recorded_once(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(Path("search_spaces/cpu_demo.yaml").read_text().split("tune:")[0] + (
        "tune:\n  micro_batch_size: [1, 2, 4]\n"
        "fixed: {moe_token_dispatcher_type: alltoall, recompute_granularity: none}\n"))
    space = load_space(path)
    proposer = Proposer(space, target_context(space), None, "t", sampler="tpe", seed=0, startup_trials=1)
    first = proposer.propose()
    proposer.complete(first, "oom", None, peak_memory_bytes=2**30)
    ran = [first.config.micro_batch_size]
    while (proposal := proposer.propose()) is not None:
        ran.append(proposal.config.micro_batch_size)
        proposer.complete(proposal, "oom", None)
    rejected = proposer.take_rejections()
    assert len(ran) + len(rejected) == 3  # every config settled exactly once, then no more proposals
    assert len({r.config for r in rejected}) == len(rejected)
    assert all(r.outcome == "oom_predicted" and r.gate == "oom_dominance" and "micro_batch_size=" in r.reason
               for r in rejected)
    assert len(proposer.study.trials) < 50  # it stopped asking once the space was exhausted


def test_warm_start_from_an_earlier_campaign_runs_its_best_first_and_avoids_its_ooms() -> None:
    context = target_context(CPU_DEMO)
    accepted = [c for c in CPU_DEMO.configs() if not violations(c, context)]
    ok = [c for c in accepted if c.micro_batch_size in (1, 2)][:6]
    oom = next(c for c in accepted if c.micro_batch_size == 4 and c.recompute_granularity == "none")
    earlier = [(config, "ok", 100.0 + index) for index, config in enumerate(ok)] + [(oom, "oom", None)]
    proposer = Proposer(CPU_DEMO, context, None, "t", sampler="random", seed=0)
    assert proposer.warm_start_from(earlier, best=2) == 2
    first, second = proposer.propose(), proposer.propose()
    assert [first.config, second.config] == [ok[-1], ok[-2]]  # best earlier values first
    assert first.origin == "earlier_campaign"
    assert proposer.history.out_of_memory == [oom]  # what needs at least its memory is rejected before launch
    for _ in range(30):
        proposal = proposer.propose()
        assert not needs_at_least_as_much_memory(proposal.config, oom)
        proposer.complete(proposal, "ok", 1.0)
