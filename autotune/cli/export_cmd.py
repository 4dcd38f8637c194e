"""``autotune export``: a config document (a run's ``winner.yaml``) as Bridge overrides, Megatron-LM
flags, YAML or JSON."""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.engine.rundir import WINNER_FILE
from autotune.export import FORMATS, TARGETS, header, load_document, render


def export(
    source: Path = typer.Argument(..., help="A run directory (its winner.yaml) or a config document."),
    fmt: str = typer.Option("bridge", "--format", "-f", help="bridge | megatron-lm | yaml | json"),
    megatron_core: str | None = typer.Option(
        None, help="megatron-core version whose names to use (default: the document's)."
    ),
    target: str | None = typer.Option(
        None, help=f"The release to paste into, for the format and version at once: {' | '.join(TARGETS)}."
    ),
    every_knob: bool = typer.Option(
        False, "--all", help="Write every knob, not only those the campaign tuned (bridge, megatron-lm)."
    ),
) -> None:
    """Print the config for Megatron-Bridge, Megatron-LM, or as a file, by default in the spelling
    of the megatron-core version the winner ran on. The flag formats start with comment lines: the
    measurement, the target version, and what the gain depends on."""
    if fmt not in FORMATS:
        raise typer.BadParameter(f"expected one of {', '.join(FORMATS)}, got {fmt!r}", param_hint="--format")
    if target is not None and target not in TARGETS:
        raise typer.BadParameter(f"expected one of {', '.join(TARGETS)}, got {target!r}", param_hint="--target")
    if target is not None and megatron_core is not None:
        raise typer.BadParameter("give --target or --megatron-core, not both", param_hint="--target")
    path = source / WINNER_FILE if source.is_dir() else source
    config, version, rest = load_document(path)
    if target is not None:
        fmt, version = TARGETS[target]
    version = megatron_core or version
    text = render(config, fmt, version, rest, every_knob)
    if fmt in ("bridge", "megatron-lm"):
        text = "\n".join([*header(config, fmt, version, rest, every_knob), text])
    typer.echo(text)
