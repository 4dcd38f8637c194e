"""``autotune knobs``: the registry as a glossary, with Megatron and Megatron-Bridge names."""

from __future__ import annotations

import typer
from rich.table import Table

from autotune.cli import console
from autotune.core.knobs import KNOBS


def knobs(
    megatron_core: str = typer.Option("0.19.2", help="megatron-core version whose field names to show."),
) -> None:
    """Every knob: values, megatron-core field, Megatron-Bridge key, Megatron-LM flag."""
    table = Table(title=f"knobs (megatron-core {megatron_core} names)", title_justify="left")
    for column in ("knob", "values", "default", "megatron-core", "Megatron-Bridge", "Megatron-LM", "what"):
        table.add_column(column, overflow="fold")
    for knob in KNOBS.values():
        field = knob.megatron_field_for(megatron_core)
        table.add_row(
            knob.name,
            knob.domain.describe(),
            knob.format(knob.default),
            f"{knob.megatron_target}.{field}" if field else knob.megatron_target,
            knob.bridge_key_for(megatron_core),
            knob.megatron_lm_flag_for(megatron_core) or "—",
            knob.doc,
        )
    console.print(table)
