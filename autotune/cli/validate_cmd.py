"""``autotune validate``: load a campaign, check it against the rules and stack assumptions."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from autotune.campaign import builtin_campaign_path, load_campaign
from autotune.cli import console
from autotune.cli._render import context_line, survey_table
from autotune.core.errors import InputFileError
from autotune.rules import violations
from autotune.survey import survey_space


def validate(
    campaign: Path | None = typer.Argument(
        None, help="Campaign YAML; defaults to the built-in CPU demo campaign."
    ),
) -> None:
    """Exit 0 if the campaign can run: it loads, its space has configs the rules accept."""
    path = campaign if campaign is not None else builtin_campaign_path("cpu_demo")
    loaded = load_campaign(path)
    context = loaded.rule_context
    survey = survey_space(loaded.space, context)
    if not survey.accepted:
        raise InputFileError(
            path, "space", f"the rules reject all {survey.total} configs of {loaded.space.name} for this campaign"
        )
    spec = loaded.spec
    console.print(f"[bold]campaign {spec.name}[/] ({path})")
    console.print(f"[dim]{context_line(context)}[/]")
    console.print(
        f"space {loaded.space.name}: {survey.total} configs, [green]{len(survey.accepted)} accepted[/], "
        f"[red]{survey.rejected} rejected[/] before launch"
    )
    if survey.rejected:
        console.print(survey_table(survey))
    for warm in loaded.space.warm_starts:
        found = violations(warm.config, context)
        if found:
            reasons = "; ".join(f"[{v.rule}] {v.reason}" for v in found)
            console.print(f"[yellow]warm start {warm.name} is skipped here:[/] {escape(reasons)}", highlight=False)
        else:
            console.print(f"warm start [bold]{warm.name}[/]: {escape(warm.config.describe())}")
    data = spec.data
    console.print(
        f"data: {data.source}{' ' + data.path if data.path else ''} ({data.realism})"
        + (" [yellow]— mock data is benchmark-only and cannot win[/]" if data.realism == "mock" else "")
    )
    workload = spec.workload
    console.print(
        "workload: "
        + (f"global batch {workload.global_batch_size} samples per step" if workload.global_batch_size
           else "no global batch (one micro-batch per replica per step: the global batch grows with MBS)")
        + f" · frozen: {', '.join(workload.frozen) or 'nothing'}"
        + (" · the search may also freeze what the space tunes" if workload.tunable_freezing else "")
    )
    console.print(
        f"budget: {spec.budget.max_trials} trials"
        + (f", {spec.budget.gpu_hours} GPU-hours" if spec.budget.gpu_hours else "")
        + (f", deadline {spec.budget.deadline.isoformat()}" if spec.budget.deadline else "")
        + f" · screen {spec.stages.screen_steps} steps (warm-up {spec.stages.warmup_steps}), "
        f"promote top {spec.stages.promote_top_k} for {spec.stages.promote_steps} steps"
        + (f", {spec.stages.promote_repeats} fresh-process runs each" if spec.stages.promote_repeats > 1 else "")
    )
    if loaded.next_space is not None:
        nxt, reachable = loaded.next_space, loaded.next_space.reachable
        then = survey_space(nxt, context)
        console.print(
            f"workflow: then space {nxt.name} ({len(then.accepted)} of {then.total} configs accepted) if its reachable "
            f"{reachable.model_tflops_per_s_per_gpu:g} model TFLOP/s per GPU ({escape(reachable.source)}) beats this "
            f"space's promoted best by more than {100 * spec.workflow.min_headroom:.0f}%",
            highlight=False,
        )
        if not then.accepted:
            raise InputFileError(path, "workflow.then_space", f"the rules reject all {then.total} configs of {nxt.name}")
    console.print(f"output: {loaded.output_dir}")
    console.print("[green]valid[/]")
