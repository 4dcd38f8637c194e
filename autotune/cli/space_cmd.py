"""``autotune space show``: what a space holds and what the rules make of it."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape

from autotune.campaign import load_campaign
from autotune.cli import console
from autotune.cli._render import context_line, space_table, survey_json, survey_table
from autotune.space import load_space, target_context
from autotune.survey import check_warm_starts, survey_space

app = typer.Typer(help="Inspect search spaces.", no_args_is_help=True)


@app.command("show")
def show(
    file: Path = typer.Argument(..., help="A space file (search_spaces/*.yaml)."),
    campaign: Path | None = typer.Option(
        None, "--campaign", "-c", help="Evaluate the rules in this campaign's context instead of the space's target."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Knobs and values, how many configs the space holds, how many the rules reject and why."""
    space = load_space(file)
    if campaign is not None:
        context = load_campaign(campaign).rule_context
    else:
        context = target_context(space)
        check_warm_starts(space, context)
    survey = survey_space(space, context)
    if as_json:
        typer.echo(json.dumps(survey_json(space, survey), indent=2))
        return
    console.print(f"[bold]{space.name}[/] — {space.description}".rstrip(" —"))
    console.print(f"[dim]{context_line(context)}[/]")
    console.print(space_table(space))
    console.print(
        f"{survey.total} configs · [green]{len(survey.accepted)} accepted[/] · "
        f"[red]{survey.rejected} rejected[/] by the rules"
    )
    if survey.rejected:
        console.print(survey_table(survey))
    for warm in space.warm_starts:
        console.print(f"warm start [bold]{warm.name}[/]: {escape(warm.config.describe())}")
