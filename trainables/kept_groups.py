"""Process groups a trainable keeps in kept ranks, for their next burst of the same layout.

Kept ranks keep their world (:func:`trainables.launch._join_process_group`) and destroy the
groups each burst made in it, or they would add up burst after burst, each NCCL one with its
communicator. megatron-core makes twenty such groups per burst; destroying them took 0.57–0.80 s
of a kept trial's 1.0–2.0 s outside its steps on an H100 in a world of one
(``bench/results/h100_kept_world_te_20261206/``), and the next burst made them and their
communicators again. Bursts whose parallel layout (the sizes the groups are made from) is the
last one's need the same groups, so the megatron trainable keeps them here with that layout, the
launcher's end of a burst spares them, and a burst of another layout destroys them before it makes
its own. Every rank of a kept world has run the same bursts (:data:`trainables.launch._world_id`),
so all hold the same layout and decide alike.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable

_kept: set[Any] = set()
_layout: Hashable | None = None


def keep(groups: Iterable[Any], layout: Hashable) -> None:
    """Keep ``groups`` (``torch.distributed`` process groups), made for ``layout``, past the burst
    that made them."""
    global _layout
    _kept.update(groups)
    _layout = layout


def kept() -> frozenset[Any]:
    return frozenset(_kept)


def kept_for(layout: Hashable) -> bool:
    """Whether groups made for ``layout`` are kept."""
    return bool(_kept) and _layout == layout


def forget() -> None:
    """They went with the world that held them, or were destroyed: nothing is kept any more."""
    global _layout
    _kept.clear()
    _layout = None
