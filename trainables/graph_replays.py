"""Counting the replays of Transformer Engine's per-layer CUDA graphs: the evidence that a
``cuda_graph_impl: transformer_engine`` trial ran graphs at all (TE's graphed callables keep no
count, and a layer with no graphs runs eagerly without a word)."""

from __future__ import annotations

from typing import Any, Callable, Iterable


class CountedGraph:
    """A graphed callable that counts its replays; ``reset`` and ``backward_dw``, which
    megatron-core calls on them, pass through."""

    def __init__(self, graph: Callable) -> None:
        self.graph = graph
        self.replays = 0

    def __call__(self, *args, **kwargs):
        self.replays += 1
        return self.graph(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.graph, name)


def count_graphs_of(layers: Iterable[Any]) -> list[CountedGraph]:
    """Wrap the graphs megatron-core's ``TECudaGraphHelper`` left in each layer's ``cuda_graphs``
    (those not wrapped yet) so that their replays count; returns the newly wrapped ones."""
    wrapped: list[CountedGraph] = []
    for layer in layers:
        graphs = getattr(layer, "cuda_graphs", None)
        if not isinstance(graphs, list) or not graphs or all(isinstance(g, CountedGraph) for g in graphs):
            continue
        layer.cuda_graphs = [g if isinstance(g, CountedGraph) else CountedGraph(g) for g in graphs]
        wrapped.extend(g for g, old in zip(layer.cuda_graphs, graphs) if g is not old)
    return wrapped
