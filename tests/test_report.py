"""`autotune report` and `autotune compare` on a real campaign's run directory (the engine tests'
campaign): the numbers shown are the run's records, the page works offline in a real headless
Chromium, and comparisons refuse different workloads."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from autotune.engine.rundir import RunDir
from autotune.report.analysis import load_report
from autotune.report.compare import compare
from conftest import autotune, entries

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Numbers(HTMLParser):
    """Every ``data-value`` on the page, by element id or by (row trial, field)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, float] = {}
        self.cells: dict[tuple[str, str], float] = {}
        self.row: str | None = None
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr":
            self.row = found.get("data-trial")
        for name in ("src", "href"):
            if (found.get(name) or "").startswith(("http:", "https:", "//")):
                self.external.append(found[name])
        if "data-value" in found:
            if found.get("id"):
                self.by_id[found["id"]] = float(found["data-value"])
            else:
                self.cells[(self.row, found["data-field"])] = float(found["data-value"])


@pytest.fixture(scope="module")
def report_page(campaign_run, cache_env, tmp_path_factory) -> tuple[Path, Path]:
    run_dir, _ = campaign_run
    page = tmp_path_factory.mktemp("report") / "report.html"
    result = autotune("report", str(run_dir), "--out", str(page), env=cache_env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device-hours" in result.stdout and str(page) in result.stdout
    assert "outside training steps (start-up, build, teardown)" in result.stdout
    assert "build, medians: data loader" in result.stdout and "after steps, medians: the trainable's end" in result.stdout
    assert "the first step's warm-up" in result.stdout
    return run_dir, page


def test_the_page_shows_the_run_records(report_page) -> None:
    run_dir, page = report_page
    numbers = Numbers()
    numbers.feed(page.read_text(encoding="utf-8"))
    records = entries(run_dir)
    promoted = [e for e in records if e.launched and e.stage == "promote"]
    assert promoted
    for entry in promoted:
        assert numbers.cells[(entry.trial_id, "objective")] == entry.objective
        assert numbers.cells[(entry.trial_id, "ci_low")] == entry.estimate.ci_low
        assert numbers.cells[(entry.trial_id, "ci_high")] == entry.estimate.ci_high
    winner = json.loads((run_dir / "leaderboard.json").read_text())
    (winner_row,) = [row for row in winner["rows"] if row["winner"]]
    assert numbers.by_id["winner-objective"] == winner_row["objective"]
    (bring_up,) = [e for e in records if e.warm_start == "bring-up"]
    assert numbers.cells[(bring_up.trial_id, "objective")] == bring_up.objective
    # the gain is the ratio of two promoted means, the winner's and bring-up's, never over a screen
    (bring_up_long,) = [e for e in promoted if e.config == bring_up.config]
    assert bring_up_long.steps == winner_row["steps"]
    assert numbers.by_id["gain"] == pytest.approx(winner_row["objective"] / bring_up_long.objective - 1)
    spend = json.loads((run_dir / "spend.json").read_text())
    assert numbers.by_id["device-hours"] == pytest.approx(spend["total"] / 3600)
    for group in ("by_stage", "by_outcome"):
        for key, seconds in spend[group].items():
            assert numbers.cells[(None, f"{group}:{key}")] == pytest.approx(seconds / 3600)
    assert numbers.cells[(None, "outside_steps")] == pytest.approx(spend["outside_steps"] / 3600)
    assert numbers.cells[(None, "first_step_excess")] == pytest.approx(spend["median_first_step_excess"])
    assert spend["by_rank_start"], "the campaign's trials say how their ranks started"
    for start, medians in spend["by_rank_start"].items():
        assert numbers.cells[(None, f"rank_start:{start}:outside_steps")] == pytest.approx(medians["outside_steps"])
    assert numbers.external == [], "the page loads nothing from the network"


def test_what_a_trial_spent_outside_its_steps_is_its_time_less_its_recorded_steps(campaign_run) -> None:
    run_dir, _ = campaign_run
    world_size = load_report(run_dir).world_size
    training: dict[str, float] = defaultdict(float)
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        step = json.loads(line)
        training[step["trial_id"]] += step["record"]["step_seconds"] * world_size
    launched = [e for e in entries(run_dir) if e.launched]
    for entry in launched:
        assert entry.training_device_seconds == pytest.approx(training[entry.trial_id])
        assert 0 < entry.training_device_seconds < entry.device_seconds
    spend = json.loads((run_dir / "spend.json").read_text())
    assert spend["outside_steps"] == pytest.approx(sum(e.device_seconds - training[e.trial_id] for e in launched))
    # where it went: the parts, timed by the trial and its rank, add up to it (wall against
    # monotonic clocks: within milliseconds), and each is time that passed
    for entry in launched:
        assert entry.outside_steps is not None, entry.trial_id
        parts = entry.outside_steps.parts()
        assert sum(parts.values()) == pytest.approx(entry.device_seconds - training[entry.trial_id], abs=0.05)
        assert min(parts.values()) > -0.05, parts
        assert parts["rank_start"] > 0 and parts["build"] > 0, parts
        # the build, part by part as the native trainable timed it: the parts lie inside the build
        # (the rest is the rank's way into the trainable), and the model's construction takes time
        phases = {phase.name: phase.seconds for phase in entry.outside_steps.build_phases}
        assert {"data loader", "model", "parallel groups, to device", "data parallel, optimizer"} <= set(phases)
        assert 0 < sum(phases.values()) <= parts["build"] + 0.01 and phases["model"] > 0, (phases, parts)
        # and the end of a burst that ran to it, part by part as the launcher and its rank 0 timed
        # it (a stopped trial's end is not waited for: its next trial's start pays it; pruned, or
        # stopped early as ok: bring-up's screen always is)
        ending = {part.name: part.seconds for part in entry.outside_steps.after_steps_parts}
        if entry.outcome == "pruned" or entry.reason.startswith("stopped early"):
            assert not ending, ending
        else:
            assert list(ending) == ["the trainable's end (its result, release)",
                                    "the burst's own process groups destroyed, the world's kept",
                                    "the ranks' exit"], (entry.outcome, ending)
            assert 0 < sum(ending.values()) <= parts["after_steps"] + 0.01, (ending, parts)
    # the first step's warm-up, inside the steps: step 0 against the trial's median step
    for entry in launched:
        steps = sorted((s for s in RunDir(run_dir).steps.read() if s.trial_id == entry.trial_id), key=lambda s: s.record.step)
        if len(steps) > 1:
            first, rest = steps[0].record.step_seconds, [s.record.step_seconds for s in steps[1:]]
            assert entry.first_step_excess == pytest.approx((first - statistics.median(rest)) * world_size, abs=2e-3)
    assert spend["median_first_step_excess"] == pytest.approx(
        statistics.median(e.first_step_excess for e in launched if e.first_step_excess is not None))
    median = spend["median_outside_split"]
    assert set(median) == {"trial_start", "rank_start", "build", "between_steps", "after_steps", "build_phases",
                           "after_steps_parts"}
    assert [phase["name"] for phase in median["build_phases"]][:2] == ["data loader", "model"]
    assert median["after_steps_parts"][-1]["name"] == "the ranks' exit"


def test_the_stage_split_is_the_steady_steps_mean(campaign_run) -> None:
    run_dir, _ = campaign_run
    report = load_report(run_dir)
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    split = report.stage_splits[0]
    entry = next(e for e in entries(run_dir) if e.trial_id == split.trial_id)
    first = entry.contract.steady_window.first_step
    steady = [s["record"] for s in steps if s["trial_id"] == split.trial_id and s["record"]["step"] >= first]
    assert split.label.startswith("winner: ")
    for part in ("vision_seconds", "projector_seconds", "decoder_seconds", "data_wait_seconds"):
        assert split.parts[part] == pytest.approx(statistics.fmean(r[part] for r in steady))
    assert split.parts["vision_seconds"] > 0 and split.parts["decoder_seconds"] > 0


def test_flags_say_what_a_reader_must_know(campaign_run, tmp_path) -> None:
    run_dir, _ = campaign_run
    report = load_report(run_dir)
    warnings = [f.text for f in report.flags if f.severity == "warning"]
    # a clean real run warns of nothing but a tie, and of a tie exactly when the verdict has one
    # (promoted configs within noise of each other, as the same config promoted in both spaces can be)
    assert [t for t in warnings if not t.startswith("tie:")] == []
    assert any(t.startswith("tie:") for t in warnings) == bool(report.verdict.tied)
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    lines = [json.loads(line) for line in (copy / "trials.jsonl").read_text().splitlines()]
    kept = [e | {"benchmark_only": True} for e in lines if e["stage"] != "promote"]
    (copy / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    (copy / "leaderboard.json").unlink()
    texts = [f.text for f in load_report(copy).flags]
    assert any(t.startswith("mock (image-free) data") for t in texts)
    assert any(t.startswith("promotion skipped") for t in texts)

    # The same run, had its promotion runs and its screens landed on two nodes: the report says so.
    spread = tmp_path / "spread"
    shutil.copytree(run_dir, spread)
    lines = [json.loads(line) for line in (spread / "trials.jsonl").read_text().splitlines()]
    for index, line in enumerate(lines):
        for worker in (line["contract"] or {}).get("workers") or []:
            worker["node_id"] = f"node-{index % 2}"
    (spread / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (spread / "leaderboard.json").unlink()
    spread_report = load_report(spread)
    flagged = {f.severity: f.text for f in spread_report.flags if "nodes" in f.text}
    assert spread_report.verdict.placements == 2 and "2 different sets of nodes and devices" in spread_report.verdict.summary
    assert flagged["warning"].startswith("the promotion runs ran on 2 different sets of nodes and devices")
    assert flagged["note"].startswith("the screens ran on 2 nodes")
    assert not any("nodes" in f.text for f in report.flags)  # as it ran: one node

    # The same run, had the workload trained the ViT and let the search freeze it: the frozen winner
    # changes what is trained, and the report says so.
    tunable = tmp_path / "tunable"
    shutil.copytree(run_dir, tunable)
    spec = yaml.safe_load((tunable / "campaign.yaml").read_text())
    spec["workload"] = {"frozen": [], "tunable_freezing": True}
    (tunable / "campaign.yaml").write_text(yaml.safe_dump(spec))
    assert any(f.severity == "warning" and f.text.startswith("the winner freezes vision_model, which the workload "
                                                             "trains") for f in load_report(tunable).flags)


def _chromium(*args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed")
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
                           *args], capture_output=True, text=True, timeout=120)


def console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def test_console_errors_are_caught(tmp_path) -> None:
    """The check below can fail: a page that throws is seen throwing."""
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>undefinedFunction()</script></body></html>")
    assert console_errors(_chromium("--dump-dom", broken.as_uri()).stderr)


def test_the_page_renders_offline_in_chromium(report_page, tmp_path) -> None:
    _, page = report_page
    dom = _chromium("--proxy-server=127.0.0.1:9", "--dump-dom", page.as_uri())  # any fetch would fail
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_errors(dom.stderr) == []
    assert 'id="leaderboard"' in dom.stdout
    for figure in ("intervals", "knob-slices", "pareto", "outcome-map", "stage-split", "spend"):
        assert f'id="{figure}"' in dom.stdout
    assert dom.stdout.count('class="main-svg"') >= 6, "plotly drew the figures"
    shot = tmp_path / "report.png"
    taken = _chromium(f"--screenshot={shot}", "--window-size=1300,2600", page.as_uri())
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    from PIL import Image

    image = Image.open(shot).convert("L")
    top, plots = image.crop((0, 0, 1300, 700)), image.crop((0, 700, 1300, 2600))
    for region in (top, plots):  # the leaderboard and the plots below it drew something
        assert region.getextrema()[0] < 100 and sum(count > 0 for count in region.histogram()) > 20


def test_compare_refuses_different_workloads_and_ranks_the_same_one(campaign_run, cache_env, tmp_path) -> None:
    run_dir, _ = campaign_run
    fsdp = tmp_path / "fsdp"
    shutil.copytree(run_dir, fsdp)
    lines = [json.loads(line) for line in (fsdp / "trials.jsonl").read_text().splitlines()]
    for entry in lines:  # the same workload trained FSDP-first, 1.5x faster per device
        entry["config"]["use_torch_fsdp2"] = True
        if entry.get("objective") is not None:
            entry["objective"] *= 1.5
            entry["estimate"] = {**entry["estimate"], **{k: entry["estimate"][k] * 1.5 for k in ("ci_low", "ci_high", "mean")}}
    (fsdp / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (fsdp / "leaderboard.json").unlink()
    result = compare(load_report(run_dir), load_report(fsdp))
    assert result.comparable and result.ratio == pytest.approx(1.5)
    assert result.a.layout.startswith("3D") and result.b.layout.startswith("FSDP")
    assert "1.500x" in result.verdict and "different nodes" not in result.verdict  # one box, one node
    elsewhere = [e | {"contract": e["contract"] and e["contract"] | {"workers": [
        w | {"node_id": "another-node"} for w in e["contract"].get("workers") or []]}} for e in lines]
    (fsdp / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in elsewhere))
    moved = compare(load_report(run_dir), load_report(fsdp))
    assert moved.ratio == pytest.approx(1.5) and "the two ran on different nodes" in moved.verdict
    (fsdp / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    printed = autotune("compare", str(run_dir), str(fsdp), "--json", env=cache_env, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert json.loads(printed.stdout)["ratio"] == pytest.approx(1.5)

    for entry in lines:
        if entry.get("contract"):
            entry["contract"]["model"]["seq_length"] *= 2
    (fsdp / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    refused = compare(load_report(run_dir), load_report(fsdp))
    assert not refused.comparable and refused.ratio is None and "seq_length" in refused.verdict

    for entry in lines:  # the same shape, in fp8: a different precision is never ranked silently
        if entry.get("contract"):
            entry["contract"]["model"]["seq_length"] //= 2
            entry["contract"]["precision"] += "; fp8 hybrid GEMMs with tensorwise scaling"
    (fsdp / "trials.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    fp8 = compare(load_report(run_dir), load_report(fsdp))
    assert not fp8.comparable and fp8.ratio is None and "precision" in fp8.verdict and "fp8" in fp8.verdict


BRIDGE_RUN = Path(__file__).resolve().parents[1] / "bench/results/h200_bridge_campaign_20261205"


def test_a_tuned_knob_without_runtime_evidence_is_flagged_only_where_the_config_sets_it(tmp_path: Path) -> None:
    """The recipe as written (no recompute, no graphs) leaves recompute modules and graph scope
    unset: nothing to observe. The winner sets them: a promoted run of it that observed no
    recompute modules is flagged."""
    def warnings(run_dir: Path) -> list[str]:
        return [flag.text for flag in load_report(run_dir).flags if "no runtime evidence" in flag.text]

    assert warnings(BRIDGE_RUN) == []
    run_dir = tmp_path / "run"
    shutil.copytree(BRIDGE_RUN, run_dir)
    lines = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    for line in lines:
        if line["stage"] == "promote" and line["config"].get("recompute_modules"):
            del line["evidence"]["checks"]["recompute_modules"]
    (run_dir / "trials.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert warnings(run_dir) == ["no runtime evidence that these tuned knobs took effect in the promoted runs: "
                                 "recompute_modules"]
