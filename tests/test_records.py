"""The campaign's records: trial entries round-trip through trials.jsonl, files of the earlier
format (``source`` and reason prefixes) still read with their fields made explicit, and a trial's
step events come back as typed records."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from autotune.core.contract import (
    BurstResult, Contract, DataProvenance, Evidence, Hardware, RankStartup, Shapes, StepRecord, StepReport, SteadyWindow,
    TimedPart,
)
from autotune.core.knobs import complete_config
from autotune.core.steady import steady_state
from autotune.engine.records import OutsideSteps, TrialEntry, read_trial_entries, spend
from autotune.engine.rundir import RunDir
from autotune.engine.trial import EndEvent, StepEvent, TrialStartup, end_result, read_result, step_result
from autotune.report.analysis import load_report

ROOT = Path(__file__).resolve().parent.parent
EARLIER_RUN = ROOT / "bench/results/h200_single_campaign"
"""A real H200 campaign's run directory, written before trial entries were typed."""

RECORD = StepRecord(step=0, step_seconds=0.5, data_wait_seconds=0.01, vision_seconds=0.1, projector_seconds=0.01,
                    decoder_seconds=0.38, useful_tokens=4000, image_tokens=900, loss_tokens=300, samples=4,
                    model_flops=2.5e12, peak_memory_bytes=2**33, loss=3.5)
CONTRACT = Contract(
    trainable="native", versions={"python": "3.11.7", "torch": "2.13.0"},
    hardware=Hardware(device="x86_64", accelerator="cpu", world_size=2, cpu_threads_per_rank=1),
    model={"name": "cpu_tiny_moe_vlm"}, data=DataProvenance(folder="/data", realism="real", tokenizer="byte-level"),
    precision="fp32", shapes=Shapes(micro_batch_size=4, seq_length=512, data_parallel=2, global_batch_size=8,
                                    expert_parallel=1),
    timing="wall clock", flops_convention="6ND", config=complete_config({"micro_batch_size": 4}),
)


def launched(**fields) -> TrialEntry:
    estimate = steady_state([1000.0, 990.0, 1010.0, 1005.0, 995.0, 1000.0, 1002.0], min_warmup=1)
    return TrialEntry(**{
        "trial_id": "t1", "stage": "screen", "space": "s", "number": 3, "origin": "warm_start", "warm_start": "bring-up",
        "config": complete_config({"micro_batch_size": 4}), "launched": True, "outcome": "ok", "reason": "ran every step",
        "steps": 7, "objective": estimate.mean, "estimate": estimate, "peak_memory_bytes": 2**33, "wall_seconds": 12.0,
        "device_seconds": 24.0, "evidence": Evidence(checks={"recompute_granularity": True}, recompute_calls=0),
        "contract": CONTRACT.model_copy(update={"steady_window": SteadyWindow(first_step=1, steps=6)}),
        "finished_at": datetime(2026, 12, 2, tzinfo=timezone.utc), **fields,
    })


def test_entries_round_trip_through_the_trials_file(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    rejected = TrialEntry(trial_id=None, stage="screen", space="s", number=4, origin="frontier",
                          config=complete_config({"micro_batch_size": 8}), launched=False, outcome="oom_predicted",
                          cause="memory_model", reason="predicted 40 GiB", device_seconds=0.0,
                          finished_at=datetime(2026, 12, 2, tzinfo=timezone.utc))
    replayed = launched(trial_id="t2", contract=Contract(trainable="replay", replayed_from="t.jsonl",
                                                         recorded={"world_size": 2}))
    entries = [launched(), rejected, replayed, launched(trial_id="t3", origin="promotion", warm_start=None,
                                                        promoted_from="t1", stage="promote", retry_of="t0")]
    for entry in entries:
        run_dir.trials.append(entry)
    assert list(run_dir.trials.read()) == entries
    line = json.loads((tmp_path / "trials.jsonl").read_text().splitlines()[0])
    assert line["contract"] == CONTRACT.to_json() | {"steady_window": {"first_step": 1, "steps": 6}}
    assert "layer_spec" not in line["contract"]  # what a trainable did not write stays unwritten
    assert line["evidence"] == {"checks": {"recompute_granularity": True}, "recompute_calls": 0}
    assert spend(entries).trials == {"screen": 2, "promote": 1} and spend(entries).rejected_before_launch == 1
    assert spend(entries).outside_steps is None  # no entry says how much of its time was training


def test_the_spend_says_what_was_not_training_and_the_median_trials_share() -> None:
    """Start-up, build and teardown are what warm workers save: device-seconds of launched trials
    outside their steps, in total and for the median trial; rejected configs cost nothing."""
    trials = [launched(trial_id=f"t{i}", device_seconds=total, training_device_seconds=training)
              for i, (total, training) in enumerate([(24.0, 20.0), (30.0, 20.0), (12.0, 11.0)])]
    rejected = TrialEntry(trial_id=None, stage="screen", space="s", number=4, origin="frontier",
                          config=complete_config({"micro_batch_size": 8}), launched=False, outcome="invalid",
                          cause="rules", reason="a rule", device_seconds=0.0,
                          finished_at=datetime(2026, 12, 2, tzinfo=timezone.utc))
    spent = spend([*trials, rejected, launched(trial_id="old")])  # "old": a line from before the field
    assert spent.outside_steps == pytest.approx(4.0 + 10.0 + 1.0)
    assert spent.median_trial_outside_steps == pytest.approx(4.0)


def test_the_spend_gives_the_medians_of_kept_ranks_apart_from_new_ones() -> None:
    """A campaign's median trial mixes kept screens with promotions in new rank processes and with
    trials out of memory before a step: the medians per rank start keep what kept ranks save in view."""
    def trial(name: str, rank_start: str | None, total: float, training: float | None,
              first_step_excess: float | None, contract: bool = True) -> TrialEntry:
        return launched(trial_id=name, device_seconds=total, training_device_seconds=training,
                        first_step_excess=first_step_excess, rank_start=rank_start,
                        contract=CONTRACT.model_copy(update={"rank_start": rank_start}) if contract else None)

    spent = spend([trial("k1", "kept", 21.0, 20.0, 3.0), trial("k2", "kept", 22.0, 20.0, None),
                   trial("k3", "kept", 12.0, 9.0, 1.0), trial("w1", "warm", 30.0, 20.0, 16.0),
                   trial("oom", "warm", 33.0, 0.0, None, contract=False).model_copy(update={  # no step, no contract
                       "out_of_memory_parts": (TimedPart("model", 4.0), TimedPart("the first step, until out of memory", 25.0))}),
                   trial("unknown", None, 5.0, 0.0, None, contract=False), trial("old", "warm", 40.0, None, None)])
    assert spent.median_trial_outside_steps == pytest.approx(4.0)  # of 1, 2, 3, 5, 10 and the OOM's 33
    assert spent.by_rank_start["kept"].model_dump() == {"trials": 3, "outside_steps": 2.0, "first_step_excess": 2.0,
                                                        "out_of_memory_trials": 0, "out_of_memory_parts": ()}
    warm = spent.by_rank_start["warm"]
    assert (warm.trials, warm.outside_steps, warm.first_step_excess) == (2, 21.5, 16.0)
    # Where the out of memory's seconds went, in the ranks it ran in
    assert warm.out_of_memory_trials == 1
    assert warm.out_of_memory_parts == (TimedPart("model", 4.0), TimedPart("the first step, until out of memory", 25.0))
    assert set(spent.by_rank_start) == {"kept", "warm"}
    # Runs recorded before the entry said it themselves: the contract's word.
    assert spend([launched(trial_id="c", device_seconds=3.0, training_device_seconds=2.0, rank_start=None,
                           contract=CONTRACT.model_copy(update={"rank_start": "kept"}))]).by_rank_start["kept"].trials == 1
    assert type(spent).model_validate_json(spent.model_dump_json()) == spent  # as spend.json holds it


def test_the_median_split_takes_each_build_phase_over_the_trials_that_had_it() -> None:
    """A graph helper is built only by graph configs: its median is theirs, not diluted by zeros."""
    def split(build: float, *phases: tuple[str, float], exit_seconds: float | None = None) -> OutsideSteps:
        return OutsideSteps(trial_start=0.1, rank_start=0.3, build=build, between_steps=0.2, after_steps=1.0,
                            build_phases=tuple(TimedPart(name, seconds) for name, seconds in phases),
                            after_steps_parts=() if exit_seconds is None else (TimedPart("exit", exit_seconds),))

    median = OutsideSteps.median([split(4.0, ("model", 2.0), ("graph helper", 1.5), exit_seconds=0.5),
                                  split(2.0, ("model", 1.0)),  # a stopped trial: its end is not timed
                                  split(3.0, ("model", 3.0), ("graph helper", 0.5), exit_seconds=0.7)])
    assert median.parts() == {"trial_start": 0.1, "rank_start": 0.3, "build": 3.0, "between_steps": 0.2,
                              "after_steps": 1.0}
    assert median.build_phases == (TimedPart("model", 2.0), TimedPart("graph helper", 1.0))
    assert median.after_steps_parts == (TimedPart("exit", 0.6),)
    assert OutsideSteps.model_validate_json(median.model_dump_json()) == median  # as spend.json holds it


def test_an_earlier_format_file_reads_with_its_origins_and_causes_explicit() -> None:
    lines = [
        {"source": "warm_start:bring-up", "reason": "ran every step", "outcome": "ok"},
        {"source": "screen:a1", "reason": "ran every step", "outcome": "ok", "stage": "promote"},
        {"source": "near_repeat", "reason": "node_lost: The actor died because its node has died", "outcome": "failed",
         "trial_id": "lost1"},
        {"source": "near_repeat, again after node_lost", "reason": "ran every step", "outcome": "ok", "trial_id": "r1"},
        {"source": "sampler", "reason": "[torch_fsdp2_needs_pp1_ep1] ...", "outcome": "invalid", "launched": False,
         "trial_id": None},
        {"source": "sampler", "reason": "needs at least the memory of micro_batch_size=4, which ran out",
         "outcome": "oom_predicted", "launched": False, "trial_id": None},
        {"source": "frontier", "reason": "stopped when the campaign's budget ran out", "outcome": "pruned",
         "contract": {"world_size": 2, "replayed_from": "table.jsonl", "steady_window": None}},
    ]
    base = {"trial_id": "x", "stage": "screen", "space": "s", "number": 1, "config": {"micro_batch_size": 2},
            "launched": True, "device_seconds": 1.0, "finished_at": "2026-12-01T00:00:00+00:00"}
    entries = list(read_trial_entries(base | line for line in lines))
    assert [(e.origin, e.warm_start, e.promoted_from) for e in entries[:2]] == [("warm_start", "bring-up", None),
                                                                               ("promotion", None, "a1")]
    lost, retry = entries[2:4]
    assert (lost.origin, lost.cause, retry.origin, retry.retry_of, retry.cause) == (
        "nearest", "node_lost", "nearest", "lost1", None)
    assert [e.cause for e in entries[4:]] == ["rules", "oom_dominance", "budget"]
    replay = entries[6].contract
    assert (replay.trainable, replay.replayed_from, replay.recorded) == ("replay", "table.jsonl", {"world_size": 2})


def test_the_committed_earlier_campaign_still_reports() -> None:
    """The H200 campaign of 2026-12-01 (written before entries were typed): the same winner; the
    gain over bring-up its CLI printed (+251 %) divided a 50-step run by an 8-step screen, so the
    report no longer quotes one and says why."""
    entries = list(RunDir(EARLIER_RUN).trials.read())
    assert [e.origin for e in entries if e.stage == "screen"][:3] == ["warm_start", "warm_start", "frontier"]
    (winner,) = [e for e in entries if e.stage == "promote"]
    assert winner.promoted_from == "95badd76" and winner.contract.shapes.micro_batch_size == 8
    report = load_report(EARLIER_RUN)
    assert report.winner == winner and report.bring_up.warm_start == "bring-up"
    assert report.winner.objective / report.bring_up.objective == pytest.approx(3.508, abs=0.001)
    assert report.gain_over_bring_up() is None
    assert any("no gain over bring-up is quoted" in flag.text for flag in report.flags)


def test_a_trials_step_and_end_events_come_back_typed() -> None:
    report = StepReport(RECORD, Evidence(checks={"expert_model_parallel_size": True}, ep_group_size=2), CONTRACT)
    event = read_result(step_result(report, "useful_tokens_per_s_per_gpu", world_size=2))
    assert isinstance(event, StepEvent) and event.record == RECORD and event.contract == CONTRACT
    assert event.objective == pytest.approx(RECORD.tokens_per_second / 2) and event.evidence.ep_group_size == 2
    end = read_result(end_result(BurstResult("oom", (RECORD,), error="x" * 5000)))
    assert isinstance(end, EndEvent) and end.outcome == "oom" and len(end.error) == 4000 and end.contract is None
    parts = (TimedPart("model", 1.5), TimedPart("the first step, until out of memory", 20.0))
    assert read_result(end_result(BurstResult("oom", before_first_step=parts))).before_first_step == parts
    assert read_result({"training_iteration": 3}) is None  # Tune's own results are no events


def test_the_first_step_brings_when_the_trial_and_its_rank_started() -> None:
    phases = (TimedPart("model", 1.5), TimedPart("optimizer", 0.5))
    report = StepReport(RECORD, Evidence(), CONTRACT, startup=RankStartup(ready_at=1010.0, first_step_at=1012.5),
                        build_phases=phases)
    event = read_result(step_result(report, "useful_tokens_per_s_per_gpu", world_size=2, trial_began_at=1009.0))
    assert event.startup == TrialStartup(trial_began_at=1009.0, ranks_ready_at=1010.0, first_step_at=1012.5,
                                         build_phases=phases)
    later = read_result(step_result(StepReport(RECORD, Evidence()), "useful_tokens_per_s_per_gpu", 2, 1009.0))
    assert later.startup is None
