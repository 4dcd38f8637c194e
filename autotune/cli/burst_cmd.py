"""``autotune burst``: one training burst of one config, its per-step table and steady summary."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from autotune.bursts import data_folder, run_burst, summarize
from autotune.campaign import builtin_campaign_path, load_campaign
from autotune.cli import console
from autotune.core.contract import BurstRequest, DataSpec
from autotune.core.errors import AutotuneError
from autotune.core.knobs import complete_config
from autotune.engine.probe import probe_this_machine, probed_stack
from autotune.rules import RuleContext, violations
from autotune.space import load_space, target_context


def burst(
    config: str = typer.Option("{}", "--config", help="JSON object of knob values; the space's fixed values fill the rest."),
    campaign: Path | None = typer.Option(None, "--campaign", "-c", help="Campaign file (default: the CPU demo)."),
    space: Path | None = typer.Option(None, "--space", "-s", help="Use this space's target instead of a campaign."),
    steps: int = typer.Option(12, min=2, help="Training steps, warm-up included."),
    warmup: int = typer.Option(2, min=1, help="Steps always treated as warm-up."),
    mock: bool = typer.Option(False, "--mock", help="Image-free mock data: benchmark-only, never a throughput result."),
    seed: int = typer.Option(0),
    workers: int = typer.Option(1, min=0, help="DataLoader worker processes per rank."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the records and summary here."),
) -> None:
    """Run one burst on this machine and print what it measured."""
    if space is not None:
        loaded_space = load_space(space)
        context = target_context(loaded_space)
        folder = data_folder("builtin_photos", None, Path.cwd())
    else:
        loaded = load_campaign(campaign or builtin_campaign_path("cpu_demo"))
        loaded_space, context = loaded.space, loaded.rule_context
        folder = data_folder(loaded.spec.data.source, loaded.spec.data.path, loaded.path.parent)
        mock = mock or loaded.spec.data.realism == "mock"
    context = _judged_by_this_machine(context)
    try:
        values = json.loads(config)
    except json.JSONDecodeError as exc:
        raise AutotuneError(f"--config: not valid JSON ({exc.msg})") from None
    if not isinstance(values, dict):
        raise AutotuneError("--config: expected a JSON object of knob values")
    chosen = complete_config(values, defaults=loaded_space.fixed)
    request = BurstRequest(
        config=chosen,
        model=context.model,
        data=DataSpec(str(folder), "mock" if mock else "real"),
        steps=steps,
        world_size=context.world_size,
        seed=seed,
        data_workers=workers,
    )
    console.print(f"[bold]{context.trainable.name}[/] burst · {context.world_size} rank(s) · {escape(chosen.describe())}")
    found = violations(chosen, context)
    if found:
        for violation in found:
            console.print(f"[red]invalid[/] {escape(f'[{violation.rule}] {violation.reason}')}", highlight=False)
        summary = {"outcome": "invalid", "violations": [asdict(v) for v in found], "config": chosen.to_plain()}
    else:
        result = run_burst(context.trainable.name, request)
        summary = summarize(request, result, min_warmup=warmup)
        _print(summary)
    if json_out is not None:
        json_out.write_text(json.dumps(summary, indent=2, default=str))
        console.print(f"wrote {json_out}")
    if summary["outcome"] != "ok":
        raise typer.Exit(1)


def _judged_by_this_machine(context: RuleContext) -> RuleContext:
    """The rules judge the config against what this machine runs (the probe), not what the
    campaign assumed: a burst of grouped GEMM runs where Transformer Engine imports."""
    stack, changes = probed_stack(context.stack, [probe_this_machine()], uses_stack=context.trainable.requires_cuda)
    for change in changes:
        console.print(f"capability probe: {escape(change)}; the rules use what this machine runs", highlight=False)
    return dataclasses.replace(context, stack=stack)


def _print(summary: dict) -> None:
    table = Table(title_justify="left")
    for column in ("step", "s", "data wait", "vision", "projector", "decoder", "useful tok", "tok/s", "loss",
                   "GFLOP", "peak MiB"):
        table.add_column(column, justify="right")
    for r in summary["records"]:
        table.add_row(
            str(r["step"]), f"{r['step_seconds']:.3f}", f"{r['data_wait_seconds']:.3f}", f"{r['vision_seconds']:.3f}",
            f"{r['projector_seconds']:.3f}", f"{r['decoder_seconds']:.3f}", str(r["useful_tokens"]),
            f"{r['tokens_per_second']:.0f}", f"{r['loss']:.3f}", f"{r['model_flops'] / 1e9:.1f}",
            f"{r['peak_memory_bytes'] / 2**20:.0f}",
        )
    console.print(table)
    console.print(f"outcome [bold]{summary['outcome']}[/]" + (f": {escape(summary['error'][-2000:])}" if summary["error"] else ""))
    steady = summary.get("steady")
    if steady:
        label = " [yellow](mock data: benchmark-only)[/]" if summary["benchmark_only"] else ""
        console.print(
            f"steady useful tokens/s {steady['mean']:.0f} (95% CI {steady['ci_low']:.0f}–{steady['ci_high']:.0f}, "
            f"±{100 * steady['relative_half_width']:.1f}%, {'converged' if steady['converged'] else 'not converged'}) "
            f"over steps {steady['warmup_steps']}–{summary['steps'] - 1}{label}"
        )
        shares = steady["stage_share"]
        console.print(
            f"data wait {100 * steady['data_wait_share']:.1f}% · vision {100 * shares['vision']:.0f}% · "
            f"projector {100 * shares['projector']:.0f}% · decoder+optimizer {100 * shares['decoder']:.0f}% · "
            f"peak {steady['peak_memory_bytes'] / 2**20:.0f} MiB"
        )
        if clock := steady["gpu_clock"]:
            console.print(f"SM clock {clock['sm_clock_mhz']:,.0f} MHz, held down in {clock['held_share']:.0%} of the "
                          f"steady steps ({', '.join(clock['held_by']) or 'nothing'})")
