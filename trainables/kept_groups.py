"""Process groups a trainable keeps in a kept rank of one-rank bursts, for its next burst.

A kept rank of one-rank bursts keeps its world (:func:`trainables.launch._join_process_group`)
and destroys the groups each burst made in it, or they would add up burst after burst, each NCCL
one with its communicator. megatron-core makes twenty such groups per burst, all of one rank;
destroying them took 0.57–0.80 s of a kept trial's 1.0–2.0 s outside its steps on an H100
(``bench/results/h100_kept_world_te_20261206/``), and the next burst made them and their
communicators again. In a world of one every burst has the same layout, so the megatron trainable
keeps its groups here for the next burst and the launcher's end of a burst spares them.
"""

from __future__ import annotations

from typing import Any, Iterable

_kept: set[Any] = set()


def keep(groups: Iterable[Any]) -> None:
    """Keep ``groups`` (``torch.distributed`` process groups) past the burst that made them."""
    _kept.update(groups)


def kept() -> frozenset[Any]:
    return frozenset(_kept)


def forget() -> None:
    """They went with the world that held them (destroyed): nothing is kept any more."""
    _kept.clear()
