"""Which failures are the cluster's, not the config's.

A node that dies under a trial (preempted, rebooted, its raylet gone) says nothing about the
config: the trial is recorded ``failed`` with the cause ``node_lost`` and run once more
elsewhere (the node is gone), and the study is not told the config failed unless the retry fails
too. Ray reports a node's death in words (``ActorDiedError`` messages, ``NodeDiedError``) whether
the trial's own actor died or a Ray Train worker it owned; both arrive here as text.
"""

from __future__ import annotations

from collections.abc import Iterator

_NODE_DEATH_MARKERS = ("node has died", "node died", "nodediederror", "node was preempted", "raylet died",
                       "node is dead")


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions behind it (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def node_lost(error: BaseException | str | None) -> str | None:
    """What Ray said of the node dying under the trial, when ``error`` (an exception, with its
    causes, or its text) is that; ``None`` otherwise."""
    if isinstance(error, BaseException):
        texts = [f"{type(e).__name__}: {e}" for e in exception_chain(error)]
    else:
        texts = [error] if error else []
    for text in texts:
        for line in text.splitlines():
            if any(marker in line.lower() for marker in _NODE_DEATH_MARKERS):
                return f"node lost: {line.strip()[:240]}"
    return None
