"""What a campaign shows while it runs: a live table on a terminal, one line per event in a log.

On a terminal (``autotune run`` by hand) a rich ``Live`` table shows the running trials, the best so
far, the outcome counts and the budget left, with a line printed above it as each trial ends.
Elsewhere (``ray job submit`` logs, CI) only the lines are printed, so the log stays readable.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from autotune.space import SearchSpace

if TYPE_CHECKING:
    from autotune.engine.ledger import Ledger
    from autotune.engine.records import TrialEntry
    from autotune.engine.tune_roles import Budget

REFRESH_SECONDS = 0.5


class LiveView:
    def __init__(self, console: Console, space: SearchSpace, objective: str) -> None:
        """``space`` names the knobs shown until a stage attaches its own."""
        self.console, self.space, self.objective = console, space, objective
        self.ledger: Ledger | None = None
        self.budget: Budget | None = None
        self.current_stage = "-"
        self.shown = 0
        self.last_refresh = 0.0
        self.live = Live(console=console, auto_refresh=False, transient=True) if console.is_terminal else None

    def __enter__(self) -> "LiveView":
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()

    def attach(self, ledger: "Ledger", budget: "Budget", space: SearchSpace) -> None:
        """Show ``space``'s stage from now on (entries from before a resume were shown back then)."""
        if self.ledger is None:
            self.shown = len(ledger.entries)
        self.ledger, self.budget, self.space = ledger, budget, space

    def stage(self, name: str) -> None:
        self.current_stage = name
        self.note(f"stage {name}")

    def note(self, text: str) -> None:
        self.console.print(f"[bold]·[/] {escape(text)}", highlight=False)

    def refresh(self) -> None:
        if self.ledger is None:
            return
        for entry in self.ledger.entries[self.shown:]:
            self.console.print(self.line(entry), highlight=False)
        self.shown = len(self.ledger.entries)
        now = time.monotonic()
        if self.live is not None and now - self.last_refresh >= REFRESH_SECONDS:
            self.last_refresh = now
            self.live.update(self.table(), refresh=True)

    def line(self, entry: TrialEntry) -> str:
        colour = {"ok": "green", "pruned": "yellow"}.get(entry.outcome, "red")
        value = f"{entry.objective:,.1f}" if entry.objective is not None else "-"
        if not entry.launched:
            return (f"  [dim]{entry.stage:<7}[/] [{colour}]{entry.outcome:<13}[/] not launched · "
                    f"{escape(self.space.describe(entry.config))} · {escape(entry.reason[:160])}")
        spread = f" ±{100 * entry.estimate.relative_half_width:.1f}%" if entry.estimate else ""
        return (f"  [dim]{entry.stage:<7}[/] [{colour}]{entry.outcome:<13}[/] {value}{spread} "
                f"{self.objective} · {entry.steps} steps · {entry.wall_seconds:.0f} s · "
                f"{escape(self.space.describe(entry.config))} · [dim]{escape(entry.reason[:120])}[/]")

    def table(self) -> Group:
        ledger, budget = self.ledger, self.budget
        running = Table(title=f"stage {self.current_stage} · running", expand=False)
        for column in ("trial", "steps", "last", "config"):
            running.add_column(column)
        for trial in ledger.live.values():
            last = f"{trial.objective[-1]:,.1f}" if trial.objective else "starting"
            running.add_row(trial.trial_id, str(len(trial.objective)), last,
                            escape(self.space.describe(trial.launch.config)))
        counts = ledger.counts()
        best = ledger.best_entry()
        summary = Table.grid(padding=(0, 2))
        summary.add_row(
            f"best {best.objective:,.1f} {self.objective}" if best else "best: none yet",
            " · ".join(f"{name} {counts[name]}" for name in ("ok", "pruned", "oom", "invalid", "oom_predicted", "failed", "hung")),
            f"left: {budget.describe()}",
            f"spent {ledger.device_seconds():,.0f} device-s",
        )
        return Group(running, summary)
