"""The report's plots, built with plotly from a :class:`~autotune.report.analysis.RunReport`.

Plotly because the reader's first question about any point is "which config is that?": hovering
answers it without a legend of twenty knobs, and the page stays one offline file (plotly.js is
embedded once). Every figure reads only the report's numbers.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.report.analysis import OUTCOMES, STAGE_PARTS, RunReport

OUTCOME_COLOURS = {"ok": "#2a9d8f", "pruned": "#8ab17d", "oom": "#e76f51", "invalid": "#9b5de5",
                   "failed": "#6c757d", "hung": "#495057", "oom_predicted": "#f4a261"}
PART_COLOURS = {"vision_seconds": "#264653", "projector_seconds": "#e9c46a", "decoder_seconds": "#2a9d8f",
                "data_wait_seconds": "#e76f51", "other_seconds": "#adb5bd"}


def _layout(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(title=title, height=height, template="plotly_white", margin={"l": 60, "r": 20, "t": 60, "b": 60})
    return fig


def intervals(report: RunReport) -> go.Figure:
    """Promoted configs and the warm-start baselines: mean with its 95 % interval."""
    rows = []
    for row in report.board.rows:
        if row.objective is None:
            continue
        tag = "winner" if row.winner else ("tied" if row.tied_with_winner else "promoted")
        rows.append((f"#{row.rank} {tag}", row.objective, row.ci_low, row.ci_high, row.config.describe()))
    for base in report.baselines:
        if base.estimate is not None:
            rows.append((f"{base.warm_start} (screen)", base.objective, base.estimate.ci_low, base.estimate.ci_high,
                         base.config.describe()))
    fig = go.Figure(go.Scatter(
        x=[r[1] for r in rows], y=[r[0] for r in rows], mode="markers",
        error_x={"type": "data", "symmetric": False, "array": [r[3] - r[1] for r in rows],
                 "arrayminus": [r[1] - r[2] for r in rows]},
        customdata=[r[4] for r in rows], hovertemplate="%{x:,.0f}<br>%{customdata}<extra></extra>",
        marker={"size": 10, "color": "#264653"}))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title=report.objective)
    return _layout(fig, "Promoted configs and baselines (mean, 95 % interval)", 160 + 40 * len(rows))


def knob_slices(report: RunReport) -> go.Figure:
    """Each tuned knob: the screened objective of every trial, by the knob's value."""
    slices = report.knob_slices()
    knobs = [k for k, points in slices.items() if len({p.value for p in points}) > 1] or list(slices)
    columns = min(3, max(1, len(knobs)))
    rows = max(1, math.ceil(len(knobs) / columns))
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=knobs, shared_yaxes=True)
    for index, knob in enumerate(knobs):
        points = slices[knob]
        for outcome in ("ok", "pruned"):
            chosen = [p for p in points if p.outcome == outcome]
            fig.add_trace(go.Scatter(
                x=[p.value for p in chosen], y=[p.objective for p in chosen], mode="markers",
                name=outcome, legendgroup=outcome, showlegend=index == 0,
                marker={"color": OUTCOME_COLOURS[outcome], "size": 9, "opacity": 0.8},
                customdata=[p.trial_id for p in chosen],
                hovertemplate="%{x}: %{y:,.0f}<br>trial %{customdata}<extra></extra>"),
                row=index // columns + 1, col=index % columns + 1)
    for index, knob in enumerate(knobs):  # values in their natural order, not in the order trials ran
        values = sorted({p.value for p in slices[knob]}, key=_natural)
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=values,
                         row=index // columns + 1, col=index % columns + 1)
    return _layout(fig, f"Screened {report.objective} against each knob", 300 * rows + 80)


def _natural(text: str) -> tuple[int, float, str]:
    """Numbers by value, then ``null``, ``false``, ``true`` and other words as text."""
    try:
        return 0, float(text), ""
    except ValueError:
        return 1, 0.0, text


def importances(report: RunReport) -> go.Figure | None:
    if not report.importances:
        return None
    fig = go.Figure()
    for space, values in report.importances.items():
        ordered = sorted(values.items(), key=lambda item: item[1])
        fig.add_trace(go.Bar(x=[v for _, v in ordered], y=[k for k, _ in ordered], orientation="h", name=space))
    fig.update_xaxes(title="fANOVA importance (share of the objective's variance)")
    height = 140 + 28 * max(len(v) for v in report.importances.values())
    return _layout(fig, "Optuna parameter importances (trials that ran)", height)


def pareto(report: RunReport) -> go.Figure:
    points = report.memory_points()
    fig = go.Figure()
    for on_front in (False, True):
        chosen = [p for p in points if p.pareto == on_front]
        fig.add_trace(go.Scatter(
            x=[p.peak_gib for p in chosen], y=[p.objective for p in chosen], mode="markers",
            name="Pareto front" if on_front else "other trials",
            marker={"size": 11 if on_front else 8, "color": "#e76f51" if on_front else "#8d99ae"},
            customdata=[f"{p.stage} {p.trial_id}: {p.config}" for p in chosen],
            hovertemplate="%{y:,.0f} at %{x:.2f} GiB<br>%{customdata}<extra></extra>"))
    front = sorted((p for p in points if p.pareto), key=lambda p: p.peak_gib)
    if len(front) > 1:
        fig.add_trace(go.Scatter(x=[p.peak_gib for p in front], y=[p.objective for p in front], mode="lines",
                                 line={"color": "#e76f51", "dash": "dot"}, showlegend=False, hoverinfo="skip"))
    fig.update_xaxes(title="peak memory per device (GiB)")
    fig.update_yaxes(title=report.objective)
    return _layout(fig, f"{report.objective} against peak memory")


def outcome_map(report: RunReport) -> go.Figure:
    """MBS x recompute: the share of proposals that could not run (OOM, predicted OOM, invalid)."""
    cells = report.outcome_map()
    batches = sorted({mbs for mbs, _ in cells}, key=int)
    recomputes = sorted({recompute for _, recompute in cells})
    share, text = [], []
    for recompute in recomputes:
        share_row, text_row = [], []
        for mbs in batches:
            counts = cells.get((mbs, recompute))
            if not counts:
                share_row.append(None)
                text_row.append("")
                continue
            failed = sum(counts[o] for o in ("oom", "oom_predicted", "invalid"))
            share_row.append(failed / sum(counts.values()))
            text_row.append("<br>".join(f"{o} {counts[o]}" for o in OUTCOMES if counts[o]))
        share.append(share_row)
        text.append(text_row)
    fig = go.Figure(go.Heatmap(
        x=[f"MBS {b}" for b in batches], y=recomputes, z=share, text=text, texttemplate="%{text}",
        colorscale=[[0, "#e9f5f2"], [1, "#e76f51"]], zmin=0, zmax=1,
        colorbar={"title": "share OOM / invalid"}, hovertemplate="%{y}, %{x}<br>%{text}<extra></extra>"))
    return _layout(fig, "Outcomes over micro-batch size × recompute", 180 + 60 * len(recomputes))


def stage_split(report: RunReport) -> go.Figure | None:
    if not report.stage_splits:
        return None
    fig = go.Figure()
    labels = [f"{s.trial_id}" for s in report.stage_splits]
    for part in (*STAGE_PARTS, "other_seconds"):
        values = [s.other_seconds if part == "other_seconds" else s.parts[part] for s in report.stage_splits]
        fig.add_trace(go.Bar(
            y=labels, x=values, orientation="h", name=part.removesuffix("_seconds").replace("_", " "),
            marker={"color": PART_COLOURS[part]}, customdata=[s.label for s in report.stage_splits],
            hovertemplate="%{x:.3f} s per step<br>%{customdata}<extra></extra>"))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title="seconds per steady step (dispatcher time is inside the decoder)")
    return _layout(fig, "Where the step goes: vision encoder, projector, decoder, data wait",
                   160 + 50 * len(labels))


def spend(report: RunReport) -> go.Figure:
    hours = report.device_hours()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("by stage", "by outcome"))
    stages = hours.by_stage
    fig.add_trace(go.Bar(x=list(stages), y=list(stages.values()), marker={"color": "#264653"}, showlegend=False,
                         hovertemplate="%{x}: %{y:.4f} device-hours<extra></extra>"), row=1, col=1)
    outcomes = {o: v for o, v in hours.by_outcome.items() if v > 0}
    fig.add_trace(go.Bar(x=list(outcomes), y=list(outcomes.values()), showlegend=False,
                         marker={"color": [OUTCOME_COLOURS.get(o, "#6c757d") for o in outcomes]},
                         hovertemplate="%{x}: %{y:.4f} device-hours<extra></extra>"), row=1, col=2)
    fig.update_yaxes(title="device-hours", row=1, col=1)
    return _layout(fig, f"Device-hours spent: {hours.total:.3f} in all")
