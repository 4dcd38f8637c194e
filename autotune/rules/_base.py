"""Rules a config must pass before launch: registered once, each a small function with a name.

A rule returns ``None`` when the config passes, or one plain sentence saying why not. Its
``source`` says whose rule it is: ``megatron-core`` (its configs raise), ``megatron-lm`` (the
training entry point raises), ``stack`` (the installed software or hardware cannot run it) or
``autotune`` (ours: the config would be a no-op duplicate of another, so it wastes a trial).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from autotune.core.contract import StackCapabilities, TrainableSupport
from autotune.core.knobs import PER_LAYER_GRAPH_IMPLS, Config
from autotune.core.model import ModelSpec

RuleSource = Literal["megatron-core", "megatron-lm", "stack", "autotune"]


@dataclass(frozen=True, slots=True)
class RuleContext:
    """Everything a rule may read besides the config: the model, the trial's size and the stack."""

    model: ModelSpec
    world_size: int
    """GPUs (or CPU worker processes) one trial runs on."""
    stack: StackCapabilities
    trainable: TrainableSupport
    global_batch_size: int | None = None
    """The workload's samples per optimizer step (``None``: the global batch follows MBS)."""
    gpus_per_node: int | None = None
    nvlink_domains_labelled: bool | None = None
    """Whether the cluster's GPU nodes say which NVLink domain they are in (``None``: no cluster
    is known, as when a campaign is validated offline)."""


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    source: RuleSource
    summary: str
    check: Callable[[Config, RuleContext], str | None]


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    source: RuleSource
    reason: str


RULES: dict[str, Rule] = {}


def rule(name: str, *, source: RuleSource, summary: str) -> Callable:
    """Register ``check`` under ``name``; names are unique so reports can group by them."""

    def register(check: Callable[[Config, RuleContext], str | None]) -> Callable:
        if name in RULES:
            raise RuntimeError(f"rule {name} is registered twice")
        RULES[name] = Rule(name=name, source=source, summary=summary, check=check)
        return check

    return register


def violations(config: Config, context: RuleContext) -> list[Violation]:
    """Every rule ``config`` breaks in ``context`` (empty when it may launch)."""
    found = []
    for registered in RULES.values():
        reason = registered.check(config, context)
        if reason is not None:
            found.append(Violation(rule=registered.name, source=registered.source, reason=reason))
    return found


# -- derived quantities rules share -----------------------------------------------------------


def per_layer_graphs(config: Config) -> bool:
    return config.cuda_graph_impl in PER_LAYER_GRAPH_IMPLS


def graph_scope(config: Config) -> frozenset[str]:
    """The modules per-layer graphs really capture: megatron-core's local implementation cannot
    separate the router from its preprocessing, so it captures both when either is listed."""
    if not per_layer_graphs(config):
        return frozenset()
    scope = set(config.cuda_graph_scope)
    if config.cuda_graph_impl == "local" and scope & {"moe_router", "moe_preprocess"}:
        scope |= {"moe_router", "moe_preprocess"}
    return frozenset(scope)


def graphs_whole_layer(config: Config) -> bool:
    """A graph captures entire layers: a full-iteration graph, or per-layer graphs with no scope."""
    return config.cuda_graph_impl == "full_iteration" or (per_layer_graphs(config) and not config.cuda_graph_scope)


def graphed(config: Config, scope: str) -> bool:
    """Whether the module ``scope`` (attn, mlp, moe…) runs inside a CUDA graph."""
    return graphs_whole_layer(config) or scope in graph_scope(config)


def selective(config: Config, module: str) -> bool:
    return config.recompute_granularity == "selective" and module in config.recompute_modules
