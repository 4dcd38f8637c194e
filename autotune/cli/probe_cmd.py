"""``autotune probe``: what this machine's stack can run (the rules read the same facts)."""

from __future__ import annotations

import json

import typer

from autotune.cli import console


def probe(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Accelerator, count and memory; torch, CUDA, megatron-core, Transformer Engine; DeepEP / HybridEP;
    IMEX channels (GB200: NVLink to other trays)."""
    from rich.table import Table

    from trainables.probe import probe as probe_machine

    facts = probe_machine()
    if as_json:
        console.print_json(json.dumps(facts))
        return
    table = Table(title="this machine's stack", title_justify="left", show_header=False)
    for key, value in facts.items():
        table.add_row(key, "—" if value is None else str(value))
    console.print(table)
