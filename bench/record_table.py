"""Record a table (autotune/core/tables.py): every config of a campaign's space, run once for real with
the campaign's trainable, model, data, trial size and memory caps, one JSON line per burst.

  python bench/record_table.py --campaign campaigns/cpu_demo.yaml --steps 30 --out bench/data/cpu_native_vlm.jsonl
  python bench/record_table.py --campaign campaigns/h200_single.yaml --steps 30 --out bench/data/h200_megatron_vlm.jsonl

Rules are not applied: a config a rule would reject runs too, and the table keeps what the
trainable did with it (a baseline without our rules pays for it). It resumes: configs already in
``--out`` are skipped, and each row is appended when its burst ends, so a killed recording loses at
most the burst in flight. Failed bursts are held back while they come in a row: ``--stop-after-failures``
of them in a row mean the harness or the machine is broken, not the configs, so the recording stops
without writing them (a later call runs them again). ``--limit`` records at most that many new rows per call (to fit a
device session); ``--order config|shuffled|best`` picks which first (``best``, with ``--ok-in``: the configs
that ran fastest there first, so that the long runs a session has time for are those of the configs
the search has to order right).

A table recorded over several device sessions is recorded on several machines, which differ (one
config ran 42 % faster on one H100 machine than on another). A call that adds rows to a table that
has some first runs the table's anchor again, the first of its rows that ran ok, and keeps that burst
beside the table (``autotune.core.tables.anchors_path``; ``--no-anchor`` skips it):
``bench/table_summary.py`` shows how fast the anchor ran on each machine.

Start-up is recorded both ways (``autotune/core/tables.py``): each burst's ranks fork anew from a
zygote the recording keeps running, as a campaign's trials' do where no rank is kept for them
(``warm_startup_seconds``; a rank kept from the row before would make a row depend on it), and a one-step
burst of the same config forks them from a zygote started for it, paying the imports
(``startup_seconds``). ``--add-warm-startup`` gives the rows of an existing table (recorded cold
only) their warm start-up from a one-step burst each.

What a burst in kept ranks pays is recorded too (``kept_startup_seconds``, ``kept_first_step_seconds``),
in a pass over the rows that ran ok, out of memory or invalid, once the recording's bursts are done
(not after long runs, ``--ok-in``, read for their steady rate only; ``--add-kept-startup`` runs only
that pass on an existing table): a short burst of each row's config
runs in the rank processes the row before's short burst kept, as a campaign's screen after a healthy
one runs. Not between the rows' own bursts: those start new rank processes and keep none. Where the
row before left none (the first row, one that ran out of memory), a config that ran ok runs first to
keep them (the row's own, if it ran ok) and the burst runs again. Only a burst that says it ran in
kept ranks (``rank_start: kept``) gives figures. Ranks are never kept under a CPU memory cap or for a
trainable that needs new processes (Bridge): there the pass is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import random
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.progress import Progress

from autotune.campaign import Campaign, load_campaign
from autotune.core.contract import BurstRequest, BurstResult
from autotune.core.knobs import Config
from autotune.core.registry import burst_runner, start_rank_zygote, trainable_support
from autotune.core.tables import RecordedBurst, anchors_path, append_row, load_table
from trainables.probe import probe

GIB = 2**30


@contextmanager
def zygote(folder: Path, name: str, trainable: str) -> Iterator[str]:
    """A new rank zygote of ``trainable`` listening in ``folder`` for as long as the block runs;
    yields its address."""
    address = str(Path(tempfile.mkdtemp(prefix=name, dir=folder), "zygote.sock"))
    process: subprocess.Popen = start_rank_zygote(address, trainable)
    try:
        yield address
    finally:
        process.kill()
        process.wait()


def timed_burst(trainable: str, request: BurstRequest, address: str) -> tuple[BurstResult, float]:
    """A burst whose ranks fork anew from the zygote at ``address``, and its start-up: its wall time
    less its steps. Never in ranks kept from the row before: a row's start-up and first step are a
    new rank process's, whatever ran before it."""
    started = time.perf_counter()
    result = burst_runner(trainable, warm_ranks=address)(dataclasses.replace(request, new_rank_processes=True))
    wall = time.perf_counter() - started
    return result, max(0.0, wall - sum(record.step_seconds for record in result.records))


KEPT_STEPS = 2
"""A kept burst's steps: its first (most of what a kept rank saves is there) and one more."""
KEPT_MEASURED = ("ok", "oom", "invalid")
"""The rows the kept pass measures: every outcome a campaign meets in kept ranks but a failure, whose
cost depends on how it failed."""


@dataclasses.dataclass(frozen=True)
class KeptBurst:
    startup_seconds: float
    first_step_seconds: float | None


def kept_burst(trainable: str, request: BurstRequest, address: str, primer: BurstRequest | None) -> KeptBurst | None:
    """Start-up and first step of a short burst of the request's config in the rank processes the
    zygote at ``address`` kept from the burst before, whatever its outcome (in kept ranks an out of
    memory costs its build, not a process's start). Where it found none kept, ``primer`` (a config
    that ran ok; ``None``: the request's own, whose first run then keeps them) runs first and the
    burst runs again; ``None`` where it still did not run in kept ranks."""
    run = burst_runner(trainable, warm_ranks=address)
    short = dataclasses.replace(request, steps=KEPT_STEPS, new_rank_processes=False)
    for attempt in range(2):
        started = time.perf_counter()
        result = run(short)
        wall = time.perf_counter() - started
        if result.rank_start == "kept":
            steps = [record.step_seconds for record in result.records]
            return KeptBurst(max(0.0, wall - sum(steps)), steps[0] if steps else None)
        if attempt == 0 and primer is not None:
            run(dataclasses.replace(primer, steps=KEPT_STEPS, new_rank_processes=False))
    return None


def cold_startup(campaign: Campaign, request: BurstRequest, folder: Path) -> float:
    """Start-up of a one-step burst of the request's config whose zygote is started for it: the
    imports a burst pays when nothing is kept warm, timed from before the zygote starts."""
    started = time.perf_counter()
    with zygote(folder, "cold", campaign.spec.trainable) as address:
        zygote_start = time.perf_counter() - started
        _, startup = timed_burst(campaign.spec.trainable, dataclasses.replace(request, steps=1), address)
    return zygote_start + startup


def add_startup(campaign: Campaign, table: Path, kept: bool) -> None:
    """Give every row of ``table`` that lacks it a warm start-up, from a one-step burst whose ranks
    fork from a zygote already running, or (``kept``) what a burst in kept ranks pays
    (:func:`kept_burst`, for the rows of ``KEPT_MEASURED``). The table is rewritten after each burst, so a
    machine taken away mid-run keeps what it measured and a new run goes on from there."""
    rows = list(load_table(table).rows.items())

    def lacks(row: RecordedBurst) -> bool:
        if kept:
            return row.outcome in KEPT_MEASURED and row.kept_startup_seconds is None
        return row.warm_startup_seconds is None

    outcomes = {config: row.outcome for config, row in rows}
    todo = [config for config, row in rows if lacks(row)]
    primer = None
    if kept:  # each row that ran out of memory after one that kept its ranks, which it then finds kept
        steady = {config: statistics.median(row.step_seconds) for config, row in rows if row.outcome == "ok"}
        if steady:  # the quickest config that ran ok
            primer = campaign.burst_request(min(steady, key=steady.__getitem__), KEPT_STEPS)
        healthy = [config for config in todo if outcomes[config] != "oom"]
        unhealthy = [config for config in todo if outcomes[config] == "oom"]
        todo = [config for pair in itertools.zip_longest(healthy, unhealthy) for config in pair if config is not None]
    what = "kept" if kept else "warm"
    print(f"{table}: {len(rows)} rows, measuring {what} start-up for {len(todo)}")
    measured: dict[Config, dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="record-") as folder, zygote(Path(folder), "warm", campaign.spec.trainable) as address, \
            Progress() as progress:
        task = progress.add_task(f"{what} start-up", total=len(todo))
        for config in todo:
            if kept:
                burst = kept_burst(campaign.spec.trainable, campaign.burst_request(config, KEPT_STEPS), address,
                                   None if outcomes[config] == "ok" else primer)
                if burst is not None:
                    measured[config] = {"kept_startup_seconds": burst.startup_seconds,
                                        "kept_first_step_seconds": burst.first_step_seconds}
            else:
                _, seconds = timed_burst(campaign.spec.trainable, campaign.burst_request(config, 1), address)
                measured[config] = {"warm_startup_seconds": seconds}
            progress.console.print(f"{config.describe()}: {measured.get(config, 'not kept')}", markup=False)
            rewritten = table.with_suffix(".rewrite")
            rewritten.unlink(missing_ok=True)
            for recorded, row in rows:
                append_row(rewritten, row.model_copy(update=measured[recorded]) if recorded in measured else row)
            os.replace(rewritten, table)
            progress.advance(task)


def record_burst(campaign: Campaign, campaign_path: Path, config: Config, steps: int, warm: str, folder: Path,
                 stack: dict) -> RecordedBurst:
    """A row: a burst of ``config`` in ranks forked anew from the zygote at ``warm``, then its cold
    start-up, with the contract it ran under and the machine it ran on."""
    request = campaign.burst_request(config, steps)
    load_before = os.getloadavg()[0]
    result, warm_startup = timed_burst(campaign.spec.trainable, request, warm)
    startup = cold_startup(campaign, request, folder)
    step_seconds = [record.step_seconds for record in result.records]
    return RecordedBurst(
        config=config.to_plain(),
        outcome=result.outcome,  # never `pruned`: nothing stops a recorded burst
        step_seconds=step_seconds,
        data_wait_seconds=[record.data_wait_seconds for record in result.records],
        sm_clock_mhz=[record.sm_clock_mhz for record in result.records],
        clock_held_by=[list(record.clock_held_by) for record in result.records],
        useful_tokens_per_step=round(sum(r.useful_tokens for r in result.records) / len(step_seconds)) if step_seconds else 0,
        peak_memory_gib=max(r.peak_memory_bytes for r in result.records) / GIB if step_seconds else None,
        startup_seconds=startup,
        warm_startup_seconds=warm_startup,
        error=None if result.error is None else result.error[-2000:],
        contract=(result.contract.to_json() if result.contract else {}) | {
            "trainable": campaign.spec.trainable,
            "world_size": request.world_size,
            "space": campaign.space.name,
            "campaign": str(campaign_path),
            "model_preset": campaign.model.name,
            "memory_cap_fraction": request.memory_cap_fraction,
            "cpu_memory_cap_bytes": request.cpu_memory_cap_bytes,
            "data_realism": request.data.realism,
            "stack": stack,
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_1m_before": load_before,
        },
    )


def _rate(row: RecordedBurst) -> str:
    steady = row.steady
    return f"{steady.mean:,.0f}" if steady is not None else row.outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--campaign", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30, help="steps per burst, warm-up included")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None, help="record at most this many new rows")
    parser.add_argument("--stop-after-failures", type=int, default=3,
                        help="stop after this many failed bursts in a row, writing none of them")
    parser.add_argument("--ok-in", type=Path, default=None,
                        help="record only configs that ran ok in this table (long runs for bench/fidelity.py)")
    parser.add_argument("--order", choices=("config", "shuffled", "best"), default="shuffled",
                        help="shuffled (seeded) spreads a partial recording over the whole space; best (with "
                             "--ok-in) records the configs that ran fastest there first")
    parser.add_argument("--no-anchor", dest="anchor", action="store_false",
                        help="add rows without running the table's anchor again first")
    parser.add_argument("--add-warm-startup", action="store_true",
                        help="record nothing new: measure the warm start-up of the rows of --out that lack it")
    parser.add_argument("--add-kept-startup", action="store_true",
                        help="record nothing new: measure what a burst in kept ranks pays for the rows of --out "
                             "that ran ok, out of memory or invalid and lack it")
    args = parser.parse_args()

    campaign = load_campaign(args.campaign)
    if args.add_kept_startup and not keeps_ranks(campaign):
        raise SystemExit(f"{args.campaign}: its bursts never run in kept ranks (a CPU memory cap, or a trainable "
                         "that needs new processes): there is nothing kept to measure")
    if args.add_warm_startup or args.add_kept_startup:
        add_startup(campaign, args.out, kept=args.add_kept_startup)
        return
    table = load_table(args.out) if args.out.is_file() and args.out.stat().st_size else None
    recorded = set(table.rows) if table is not None else set()
    todo = [config for config in campaign.space.configs() if config not in recorded]
    if args.order == "best" and args.ok_in is None:
        raise SystemExit("--order best ranks configs by their rows in --ok-in: give --ok-in")
    if args.ok_in is not None:
        steady_rates = {config: row.steady.mean for config, row in load_table(args.ok_in).rows.items()
                        if row.steady is not None}  # the rows that ran ok, long enough for a rate
        todo = [config for config in todo if config in steady_rates]
        if args.order == "best":
            todo.sort(key=steady_rates.__getitem__, reverse=True)
    if args.order == "shuffled":
        random.Random(0).shuffle(todo)
    todo = todo[: args.limit] if args.limit is not None else todo
    anchor = next((config for config, row in table.rows.items() if row.outcome == "ok"), None) \
        if args.anchor and table is not None and todo else None
    stack = probe()
    print(f"{campaign.space.name}: {campaign.space.size()} configs, {len(recorded)} recorded, recording {len(todo)}")
    held: list[RecordedBurst] = []
    with tempfile.TemporaryDirectory(prefix="record-") as folder, zygote(Path(folder), "warm", campaign.spec.trainable) as warm, \
            Progress() as progress:
        if anchor is not None:
            row = record_burst(campaign, args.campaign, anchor, args.steps, warm, Path(folder), stack)
            append_row(anchors_path(args.out), row)
            before = table.rows[anchor]
            progress.console.print(f"anchor {anchor.describe()}: {_rate(row)} useful tokens/s on this machine, "
                                   f"{_rate(before)} in its row ({before.contract.get('recorded_at')})", markup=False)
        task = progress.add_task("recording", total=len(todo))
        for config in todo:
            row = record_burst(campaign, args.campaign, config, args.steps, warm, Path(folder), stack)
            progress.console.print(f"{config.describe()}: {row.outcome} {len(row.step_seconds)} steps, start-up "
                                   f"{row.warm_startup_seconds:.1f} s warm, {row.startup_seconds:.1f} s cold", markup=False)
            progress.advance(task)
            if row.outcome == "failed":
                held.append(row)
                if len(held) >= args.stop_after_failures:
                    progress.console.print(f"{len(held)} bursts failed in a row; stopping without recording them. "
                                           f"The last error:\n{row.error}", markup=False)
                    raise SystemExit(1)
                continue
            for finished in [*held, row]:
                append_row(args.out, finished)
            held.clear()
    for finished in held:  # failures that ended the list but not a streak
        append_row(args.out, finished)
    if keeps_ranks(campaign) and args.ok_in is None:  # long runs are read for their steady rate, not start-up
        add_startup(campaign, args.out, kept=True)


def keeps_ranks(campaign: Campaign) -> bool:
    """Whether the campaign's bursts may run in kept ranks (see the module's docstring)."""
    return campaign.spec.hardware.cpu_memory_cap_gib is None and trainable_support(campaign.spec.trainable).kept_ranks


if __name__ == "__main__":
    main()
