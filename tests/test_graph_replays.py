"""TE graph replays counted: the evidence a ``cuda_graph_impl: transformer_engine`` trial graphed."""

from __future__ import annotations

from types import SimpleNamespace

from trainables.graph_replays import CountedGraph, count_graphs_of


def test_the_graphs_a_helper_left_in_layers_are_wrapped_once_and_their_replays_counted() -> None:
    calls: list[int] = []

    def graph(x: int) -> int:
        calls.append(x)
        return x + 1

    graph.reset = lambda: "reset"  # megatron-core calls reset() and backward_dw() on the graphs
    graphed = SimpleNamespace(cuda_graphs=[graph, graph])
    eager = SimpleNamespace(cuda_graphs=[])
    layers = [graphed, eager, SimpleNamespace()]

    wrapped = count_graphs_of(layers)
    first = graphed.cuda_graphs
    assert wrapped == first and len(wrapped) == 2
    assert all(isinstance(g, CountedGraph) for g in first) and eager.cuda_graphs == []
    assert count_graphs_of(layers) == [], "a graph already counted is not wrapped again"
    assert [first[0](1), first[1](2), first[1](3)] == [2, 3, 4] and calls == [1, 2, 3]
    assert [g.replays for g in first] == [1, 2] and first[0].reset() == "reset"

    recaptured = SimpleNamespace(cuda_graphs=[graph])
    assert len(count_graphs_of([graphed, recaptured])) == 1, "graphs captured later are counted from then on"
