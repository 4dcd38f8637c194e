"""Which parts of the decoder layers Transformer Engine's graphs really covered: the evidence for
``cuda_graph_scope``.

Why: megatron-core scopes TE's per-layer graphs by the config's ``cuda_graph_modules`` (before
0.18 ``cuda_graph_scope``), and a graph replays whatever part it captured. Counting replays proves
graphs ran, not which parts they hold: the same 16 graphs replayed under ``[attn]`` and under
``[attn, moe_router, moe_preprocess]`` on the H100 (``bench/results/h100_kept_world_te_20261206/``).
What does tell is Python: once captured, a graphed part's Python never runs again (the replay
stands in for it), while a part outside the graph runs every step. So after the capture this
watches each layer's attention, MLP or MoE layer, router and token-dispatch preprocessing, and a
scope name counts as graphed when its part ran in no layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from autotune.core.knobs import CUDA_GRAPH_SCOPES

MOE_PARTS = ("moe_router", "moe_preprocess")
"""Scope names inside a MoE layer's MLP: a graph of the whole MoE layer (``moe``) holds them."""


@dataclass
class _Calls:
    count: int = 0

    def hook(self, *_: Any) -> None:
        self.count += 1

    def wrap(self, method: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return method(*args, **kwargs)

        return counted


@dataclass
class GraphScopeWatch:
    """Python calls of each scope name's part in every decoder layer of this rank since the watch
    began (right after the capture). ``close`` undoes every hook and wrapper."""

    calls: dict[str, list[_Calls]] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def of(cls, layers: Iterable[Any]) -> GraphScopeWatch:
        watch = cls()
        for layer in layers:
            watch._module("attn", layer.self_attention)
            if not layer.is_moe_layer:
                watch._module("mlp", layer.mlp)
                continue
            watch._module("moe", layer.mlp)
            watch._module("moe_router", layer.mlp.router)
            # The token dispatcher is no module: its preprocessing runs only outside a graph that holds it.
            watch._method("moe_preprocess", layer.mlp.token_dispatcher, "dispatch_preprocess")
        return watch

    def _module(self, name: str, module: Any) -> None:
        calls = self.calls.setdefault(name, [])
        calls.append(_Calls())
        self._undo.append(module.register_forward_pre_hook(calls[-1].hook).remove)

    def _method(self, name: str, owner: Any, method: str) -> None:
        calls = self.calls.setdefault(name, [])
        calls.append(_Calls())
        setattr(owner, method, calls[-1].wrap(getattr(owner, method)))
        self._undo.append(lambda: delattr(owner, method))

    def graphed(self) -> list[str]:
        """The scope names whose part ran in no layer, in the knob's order; the MoE parts are left
        out when the whole MoE layer is graphed, as a config names only ``moe`` then."""
        graphed = [name for name in CUDA_GRAPH_SCOPES
                   if self.calls.get(name) and all(c.count == 0 for c in self.calls[name])]
        if "moe" in graphed:
            graphed = [name for name in graphed if name not in MOE_PARTS]
        return graphed

    def expected(self, scope: Iterable[str]) -> list[str]:
        """What ``graphed`` should be under a config's scope on these layers: an empty scope graphs
        the whole layer; a name with no part here (``mlp`` in a model of MoE layers only) is left out."""
        wanted = set(scope) or {"attn", "mlp", "moe"}
        if "moe" in wanted:
            wanted -= set(MOE_PARTS)
        return [name for name in CUDA_GRAPH_SCOPES if name in wanted and self.calls.get(name)]

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
