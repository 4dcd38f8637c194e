"""The self-contained HTML report: one file, plotly.js inside, nothing fetched when it opens.

Numbers in tables carry their raw value (``data-value``) beside the rounded text, so the page can
be checked against the run's records (the tests do).
"""

from __future__ import annotations

import datetime
import json
from html import escape
from typing import Any

import plotly.offline

from autotune.report import figures
from autotune.report.analysis import RunReport

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 0.2rem; } .sub { color: #666; margin-top: 0; }
.flags { border-left: 6px solid #e76f51; background: #fff4f0; padding: 0.6rem 1rem; margin: 1rem 0; }
.flags li.note { color: #555; } .flags li.warning { font-weight: 600; }
.headline { display: flex; gap: 2rem; margin: 1rem 0; } .headline div { background: #f1f6f5; padding: 0.8rem 1.2rem; }
.headline b { display: block; font-size: 1.5rem; }
table { border-collapse: collapse; width: 100%; font-size: 0.9rem; }
th, td { border-bottom: 1px solid #ddd; padding: 0.35rem 0.5rem; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.winner { background: #e9f5f2; } tr.baseline { color: #555; }
pre { background: #f6f6f6; padding: 1rem; overflow-x: auto; font-size: 0.8rem; }
"""


def _number(value: float | None, digits: int = 0, field: str = "") -> str:
    if value is None:
        return '<td class="num">–</td>'
    return f'<td class="num" data-field="{field}" data-value="{value!r}">{value:,.{digits}f}</td>'


def _leaderboard(report: RunReport) -> str:
    head = ("<tr><th>#</th><th>status</th><th>space</th><th>config</th><th>objective</th><th>95 % low</th>"
            "<th>95 % high</th><th>screened</th><th>steps</th></tr>")
    rows = []
    for row in report.board.rows:
        status = "winner" if row.winner else ("tied" if row.tied_with_winner else (
            f"ruled out: {row.ruled_out}" if row.ruled_out else row.outcome))
        rows.append(
            f'<tr class="{"winner" if row.winner else "promoted"}" data-trial="{escape(row.trial_id)}">'
            f"<td>{row.rank}</td><td>{escape(status)}</td><td>{escape(row.space)}</td>"
            f"<td>{escape(row.config.describe())}</td>"
            f"{_number(row.objective, field='objective')}{_number(row.ci_low, field='ci_low')}"
            f"{_number(row.ci_high, field='ci_high')}{_number(row.screen_objective, field='screen_objective')}"
            f"<td>{row.steps if row.processes == 1 else f'{row.processes} × {row.steps}'} "
            f"({row.steady_steps or 0} steady)</td></tr>")
    for base in report.baselines:
        estimate = base.estimate
        rows.append(
            f'<tr class="baseline" data-trial="{escape(base.trial_id)}"><td></td>'
            f"<td>baseline {escape(base.warm_start)}: {escape(base.outcome)}</td>"
            f"<td>{escape(base.space)}</td><td>{escape(base.config.describe())}</td>"
            f"{_number(base.objective, field='objective')}"
            f"{_number(estimate.ci_low if estimate else None, field='ci_low')}"
            f"{_number(estimate.ci_high if estimate else None, field='ci_high')}<td></td>"
            f"<td>{base.steps} (screen)</td></tr>")
    return f'<table id="leaderboard">{head}{"".join(rows)}</table>'


def _spend_table(report: RunReport) -> str:
    hours = report.device_hours()
    cells = "".join(f"<tr><td>{escape(group)}</td><td>{escape(key)}</td>{_number(value, 4, f'{group}:{key}')}</tr>"
                    for group, split in (("by_stage", hours.by_stage), ("by_outcome", hours.by_outcome))
                    for key, value in split.items())
    outside = report.spend.outside_steps
    if outside is not None:
        cells += (f"<tr><td>outside training steps</td><td>start-up, build, teardown</td>"
                  f"{_number(outside / 3600, 4, 'outside_steps')}</tr>")
    if (parts := report.spend.median_outside_split) is not None:
        cells += "".join(f"<tr><td>outside steps, median trial (device-s)</td><td>{escape(part.replace('_', ' '))}</td>"
                         f"{_number(seconds, 2, f'outside:{part}')}</tr>" for part, seconds in parts.parts().items())
        cells += "".join(f"<tr><td>{what}, median trial (device-s)</td><td>{escape(part.name)}</td>"
                         f"{_number(part.seconds, 2, escape(f'{what}:{part.name}'))}</tr>"
                         for what, split in parts.split_parts().items() for part in split)
    if (warm_up := report.spend.median_first_step_excess) is not None:
        cells += (f"<tr><td>the first step's warm-up, median trial (device-s)</td><td>over its median step</td>"
                  f"{_number(warm_up, 2, 'first_step_excess')}</tr>")
    for start, medians in sorted(report.spend.by_rank_start.items()):
        what = f"ranks {start}, median of {medians.trials} trial{'s' if medians.trials > 1 else ''} (device-s)"
        cells += (f"<tr><td>{escape(what)}</td><td>outside steps</td>"
                  f"{_number(medians.outside_steps, 2, f'rank_start:{start}:outside_steps')}</tr>")
        if medians.first_step_excess is not None:
            cells += (f"<tr><td>{escape(what)}</td><td>the first step's warm-up</td>"
                      f"{_number(medians.first_step_excess, 2, f'rank_start:{start}:first_step_excess')}</tr>")
        what = f"out of memory before a step, ranks {start}, median of {medians.out_of_memory_trials} (device-s)"
        cells += "".join(f"<tr><td>{escape(what)}</td><td>{escape(part.name)}</td>"
                         f"{_number(part.seconds, 2, escape(f'rank_start:{start}:oom:{part.name}'))}</tr>"
                         for part in medians.out_of_memory_parts)
    return (f'<table id="spend"><tr><th>split</th><th></th><th>device-hours</th></tr>{cells}'
            f"<tr><td>total</td><td></td>{_number(hours.total, 4, 'total')}</tr></table>")


def _headline(report: RunReport) -> str:
    parts = []
    if report.winner is not None:
        winner = report.winner
        parts.append(f'<div>winner<b id="winner-objective" data-value="{winner.objective!r}">'
                     f'{winner.objective:,.0f}</b>{escape(report.objective)} '
                     f'(95 % {winner.estimate.ci_low:,.0f}–{winner.estimate.ci_high:,.0f})</div>')
    gain = report.gain_over_bring_up()
    if gain is not None:
        verdict = "a tie: the intervals overlap" if gain.tie else f"{gain.low:+.1%} to {gain.high:+.1%}"
        parts.append(f'<div>over bring-up<b id="gain" data-value="{gain.value!r}">{gain.value:+.1%}</b>'
                     f'{verdict}; bring-up {report.bring_up_promoted.objective:,.0f} over the same '
                     f'{gain.steps} steps' + (f', {gain.processes} fresh-process runs of each' if gain.processes > 1 else '')
                     + '</div>')
    total = report.device_hours().total
    parts.append(f'<div>spent<b id="device-hours" data-value="{total!r}">{total:.3f}</b>device-hours, '
                 f"{len(report.launched())} trials launched</div>")
    return f'<div class="headline">{"".join(parts)}</div>'


def _figure(fig: Any, div_id: str) -> str:
    if fig is None:
        return ""
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def render_html(report: RunReport) -> str:
    flags = "".join(f'<li class="{f.severity}">{escape(f.text)}</li>' for f in report.flags)
    contract = json.dumps({"winner (else first trial)": report.contract.to_json() if report.contract
                           else "no contract recorded",
                           "cluster probe": report.probe or "no probe recorded"}, indent=1, default=str)
    sections = [
        ("Leaderboard", _headline(report) + _leaderboard(report) + _figure(figures.intervals(report), "intervals")),
        ("Knobs", _figure(figures.knob_slices(report), "knob-slices") + _figure(figures.importances(report),
                                                                                 "importances")),
        ("Memory", _figure(figures.pareto(report), "pareto") + _figure(figures.outcome_map(report), "outcome-map")),
        ("Stage split", _figure(figures.stage_split(report), "stage-split")),
        ("Cost", _figure(figures.spend(report), "spend") + _spend_table(report)),
        ("Measurement contract", f"<pre id=\"contract\">{escape(contract)}</pre>"),
    ]
    body = "".join(f"<h2>{escape(title)}</h2>{content}" for title, content in sections)
    generated = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(report.campaign)}: autotune report</title><style>{STYLE}</style>"
        f"<script>{plotly.offline.get_plotlyjs()}</script></head><body>"
        f"<h1>{escape(report.campaign)}</h1><p class=\"sub\">{escape(str(report.path))} · "
        f"{escape(report.verdict.summary)} · generated {generated}</p>"
        f"<ul class=\"flags\" id=\"flags\">{flags or '<li class=note>nothing flagged</li>'}</ul>"
        f"{body}</body></html>"
    )
