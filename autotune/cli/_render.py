"""Rich renderings shared by the commands."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from autotune.core.knobs import KNOBS
from autotune.rules import RULES, RuleContext
from autotune.space import SearchSpace
from autotune.survey import SpaceSurvey


def space_table(space: SearchSpace) -> Table:
    table = Table(title=f"space {space.name}", title_justify="left")
    table.add_column("knob")
    table.add_column("values")
    table.add_column("applies when")
    for name, knob in KNOBS.items():
        if name in space.tuned:
            values = escape(", ".join(knob.format(v) for v in space.tuned[name]))
        elif name in space.fixed:
            values = f"[dim]fixed[/] {escape(knob.format(space.fixed[name]))}"
        else:
            continue
        table.add_row(name, values, knob.active_when.text if knob.active_when else "")
    return table


def context_line(context: RuleContext) -> str:
    stack = context.stack
    te = stack.transformer_engine or "none"
    return (
        f"model {context.model.name} · trainable {context.trainable.name} · {context.world_size} "
        f"GPU(s) per trial · {stack.accelerator} · megatron-core {stack.megatron_core or 'none'} · TE {te}"
    )


def survey_table(survey: SpaceSurvey) -> Table:
    table = Table(title="rejections by rule", title_justify="left")
    table.add_column("rule")
    table.add_column("source")
    table.add_column("configs", justify="right")
    table.add_column("why (first example)")
    for name, count in survey.rejected_by_rule.most_common():
        table.add_row(name, RULES[name].source, str(count), escape(survey.example[name]))
    return table


def survey_json(space: SearchSpace, survey: SpaceSurvey) -> dict:
    return {
        "space": space.name,
        "path": str(space.path),
        "configs": survey.total,
        "accepted": len(survey.accepted),
        "rejected": survey.rejected,
        "rejected_by_rule": {
            name: {"count": count, "source": RULES[name].source, "example": survey.example[name]}
            for name, count in survey.rejected_by_rule.most_common()
        },
        "warm_starts": [{"name": w.name, "config": w.config.to_plain()} for w in space.warm_starts],
    }
