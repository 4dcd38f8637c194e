"""``autotune run`` and ``autotune resume``: a campaign on a Ray cluster, its verdict and winner.

The engine (Ray Tune) is imported by these two commands only, and plotly once they draw the report:
every other command starts without them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from autotune.campaign import Campaign, builtin_campaign_path, freezing_warning, load_campaign
from autotune.cli import console
from autotune.core.errors import InputFileError
from autotune.engine.rundir import REPORT_FILE, WINNER_FILE, create_run_dir, open_run_dir
from autotune.core.tool_flags import ExportRefused
from autotune.export import render
from autotune.report.analysis import load_report
from autotune.survey import survey_space

if TYPE_CHECKING:
    from autotune.engine.driver import CampaignOutcome
    from autotune.engine.records import TrialEntry

ADDRESS_HELP = "Ray cluster address (default: RAY_ADDRESS, the job's cluster, or a new local one)."


def run(
    campaign: Path | None = typer.Argument(None, help="Campaign YAML; defaults to the built-in CPU demo campaign."),
    address: str | None = typer.Option(None, "--address", help=ADDRESS_HELP),
    output_dir: Path | None = typer.Option(None, "--output-dir", "-o", help="Override the campaign's output_dir."),
) -> None:
    """Run a campaign: screen configs as Ray Tune trials, promote the best, export the winner."""
    from autotune.engine.driver import connect, run_campaign
    from autotune.engine.live import LiveView

    path = campaign if campaign is not None else builtin_campaign_path("cpu_demo")
    loaded = load_campaign(path)
    if not survey_space(loaded.space, loaded.rule_context).accepted:
        raise InputFileError(path, "space", f"the rules reject every config of {loaded.space.name} for this campaign")
    run_dir = create_run_dir(loaded, output_dir)
    console.print(f"[bold]{escape(loaded.spec.name)}[/] · outputs in [bold]{escape(str(run_dir.path))}[/]")
    connect(address)
    with LiveView(console, loaded.space, loaded.spec.objective) as view:
        outcome = run_campaign(loaded, run_dir, view)
    _report(loaded, outcome)


def resume(
    run_dir: Path = typer.Argument(..., help="The run directory an interrupted `autotune run` printed."),
    address: str | None = typer.Option(None, "--address", help=ADDRESS_HELP),
) -> None:
    """Continue an interrupted campaign: finished trials are kept, the study goes on."""
    from autotune.engine.driver import connect, resume_campaign
    from autotune.engine.live import LiveView

    opened = open_run_dir(run_dir)
    loaded = opened.load_campaign()
    console.print(f"resuming [bold]{escape(loaded.spec.name)}[/] in [bold]{escape(str(run_dir))}[/]")
    connect(address)
    with LiveView(console, loaded.space, loaded.spec.objective) as view:
        outcome = resume_campaign(run_dir, view)
    _report(loaded, outcome)


def _report(campaign: Campaign, outcome: CampaignOutcome) -> None:
    from autotune.report.page import render_html  # plotly: imported by the commands that draw only

    spaces = {space.name: space for space in campaign.spaces}

    def knobs(entry: TrialEntry) -> str:
        return escape(spaces[entry.space].describe(entry.config))

    promoted = sorted(outcome.verdict.promoted, key=lambda e: -(e.objective or 0.0))  # a row per config
    table = Table(title=f"promotion ({campaign.spec.stages.promote_steps} steps) · {campaign.spec.objective}")
    for column in ("", "space", "mean", "95% interval", "runs", "steady steps", "config"):
        table.add_column(column)
    winner_id = outcome.verdict.winner.trial_id if outcome.verdict.winner else None
    for entry in promoted:
        estimate = entry.estimate
        table.add_row(
            "winner" if entry.trial_id == winner_id else entry.outcome,
            entry.space,
            f"{entry.objective:,.1f}" if entry.objective is not None else "-",
            f"{estimate.ci_low:,.1f}–{estimate.ci_high:,.1f}" if estimate else "-",
            str(entry.processes),
            str(estimate.window) if estimate else "-",
            knobs(entry),
        )
    console.print(table)
    spend = outcome.spend
    console.print(
        f"spent {spend.total:,.0f} device-seconds · screening trials {spend.trials['screen']}, "
        f"promoted {spend.trials['promote']}, rejected before launch {spend.rejected_before_launch} · "
        + " · ".join(f"{name} {seconds:,.0f} s" for name, seconds in sorted(spend.by_outcome.items()))
    )
    for entry, why in outcome.verdict.disqualified:
        console.print(f"[yellow]ruled out[/] {knobs(entry)}: {escape(why)}")
    if outcome.verdict.winner is None:
        console.print(f"[bold red]no winner:[/] {escape(outcome.verdict.summary)}")
    else:
        winner = outcome.verdict.winner
        console.print(f"[bold green]winner[/] ({escape(outcome.verdict.summary)}): {knobs(winner)}")
        try:
            overrides = render(winner.config, "bridge", campaign.stack.megatron_core,
                               {"workload": campaign.spec.workload.model_dump(), "tuned": campaign.tuned_knobs})
            console.print("Megatron-Bridge overrides:", highlight=False)
            console.print(escape(overrides), highlight=False, soft_wrap=True)
        except ExportRefused as refused:
            console.print(f"[bold yellow]no Megatron-Bridge overrides:[/] {escape(str(refused))}", highlight=False)
        for part in campaign.frozen_beyond_workload(winner.config):
            console.print(f"[bold yellow]warning:[/] {escape(freezing_warning(part))}", highlight=False)
        console.print(
            f"winner: {escape(str(outcome.run_dir.path / WINNER_FILE))} · other formats: "
            f"autotune export {escape(str(outcome.run_dir.path))} --format megatron-lm|yaml|json",
            highlight=False, soft_wrap=True,
        )
    outcome.run_dir.write_text(REPORT_FILE, render_html(load_report(outcome.run_dir.path)))
    console.print(f"report: {escape(str(outcome.run_dir.path / REPORT_FILE))}", highlight=False, soft_wrap=True)
    console.print(f"outputs: {escape(str(outcome.run_dir.path))}", highlight=False, soft_wrap=True)
