"""Warm rank processes for a campaign: one rank zygote per node, kept for the whole campaign.

A trial's process is new for each trial (Tune's ``reuse_actors`` stays off: a trial process ends
with its trial, so nothing a stopped burst left behind reaches the next). What a trial pays to
start its ranks is the imports, and those a zygote holds: a process that imported torch and the
trainables once and forks each rank (``trainables.zygote``). Here a Ray actor on every node with
CPUs to run trials starts one; a trial finds its node's zygote at a path named after the campaign's
token and the node (:func:`zygote_address`) and hands it to the burst runner. A node that joined
after the campaign started has none: its trials start their ranks cold, and say so (the contract's
``rank_start``). The driver owns the actors, so they and their zygotes end with it, even when it is
killed.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from autotune.core.registry import start_rank_zygote

log = logging.getLogger(__name__)

ZYGOTE_START_TIMEOUT_S = 120
"""How long a node's zygote may take to start (its imports take seconds; a node that does not
answer in this time runs its trials' ranks cold)."""


def zygote_address(token: str, node_id: str) -> str:
    """Where node ``node_id``'s zygote of campaign ``token`` listens (a Unix socket: short path)."""
    return str(Path(tempfile.gettempdir(), f"autotune-ranks-{token}", f"{node_id[:16]}.sock"))


@ray.remote(num_cpus=0)
class _NodeZygote:
    """Starts its node's zygote and keeps it: the zygote ends with this actor's process."""

    def __init__(self, address: str, trainable: str) -> None:
        Path(address).parent.mkdir(mode=0o700, exist_ok=True)
        self.process = start_rank_zygote(address, trainable)

    def pid(self) -> int:
        return self.process.pid


@contextmanager
def warm_ranks(trainable: str | None) -> Iterator[str | None]:
    """Start a zygote holding ``trainable``'s imports on every alive node with CPUs and yield the
    campaign's token (``None`` when ``trainable`` is ``None`` or no zygote started); stop them after."""
    if trainable is None:
        yield None
        return
    token = uuid.uuid4().hex[:8]
    actors = [
        _NodeZygote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
        .remote(zygote_address(token, node["NodeID"]), trainable)
        for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0
    ]
    try:
        ready = []
        for actor in actors:
            try:
                ray.get(actor.pid.remote(), timeout=ZYGOTE_START_TIMEOUT_S)
                ready.append(actor)
            except ray.exceptions.RayError as exc:  # that node's trials start their ranks cold
                log.warning("no warm rank zygote on a node: %s", exc)
        yield token if ready else None
    finally:
        for actor in actors:
            ray.kill(actor)
