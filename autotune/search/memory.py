"""Which configs surely need at least the memory of one that already ran out of it.

Only what is monotone in memory is compared: with every other knob equal (the same layout), a
larger micro-batch, a recompute that saves no more, no more frozen parts, and CUDA graphs where the
reference had none cannot use less memory. Recompute savings are ordered none < selective < full;
two selective sets compare by inclusion; full recompute compares within one method (block: more
layers save more). Graphs keep static input and output buffers and a private memory pool on top of
what the same layer needs ungraphed (on the H200 table every graphed config's peak is above its
ungraphed twin's, and none fits where the twin ran out); two graph settings compare only when equal.
"""

from __future__ import annotations

from autotune.core.knobs import FREEZE_KNOBS_BY_PART, KNOBS, Config

FREEZE_KNOBS = tuple(FREEZE_KNOBS_BY_PART.values())
MEMORY_KNOBS = frozenset({
    "micro_batch_size", "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    *FREEZE_KNOBS,
})
GRAPH_KNOBS = frozenset({"cuda_graph_impl", "cuda_graph_scope"})
_SAVING = {"none": 0, "selective": 1, "full": 2}


def recompute_saving(config: Config) -> tuple[int, int]:
    """A rank of the activation memory a recompute setting saves: none, then selective sets by
    size, then full (consistent with :func:`recompute_saves_no_more`)."""
    granularity = config.recompute_granularity
    return _SAVING[granularity], len(config.recompute_modules or ()) if granularity == "selective" else 0


def recompute_saves_no_more(candidate: Config, reference: Config) -> bool:
    mine, theirs = candidate.recompute_granularity, reference.recompute_granularity
    if mine != theirs:
        return _SAVING[mine] < _SAVING[theirs]
    if mine == "selective":
        return set(candidate.recompute_modules) <= set(reference.recompute_modules)
    if mine == "full":
        if candidate.recompute_method != reference.recompute_method:
            return False
        if candidate.recompute_method == "block":
            return candidate.recompute_num_layers <= reference.recompute_num_layers
        return candidate.recompute_num_layers == reference.recompute_num_layers
    return True


def needs_at_least_as_much_memory(candidate: Config, reference: Config) -> bool:
    """True when ``candidate`` cannot use less memory than ``reference`` (same layout, see above)."""
    if any(candidate[name] != reference[name] for name in KNOBS if name not in MEMORY_KNOBS | GRAPH_KNOBS):
        return False
    if reference.cuda_graph_impl != "none" and any(candidate[name] != reference[name] for name in GRAPH_KNOBS):
        return False
    if candidate.micro_batch_size < reference.micro_batch_size:
        return False
    if any(candidate[name] and not reference[name] for name in FREEZE_KNOBS):
        return False
    return recompute_saves_no_more(candidate, reference)
