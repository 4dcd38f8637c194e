"""What the megatron-core trainable honours (plain data; importing it needs no megatron).

Every knob but full-iteration graphs maps to megatron-core; what the installed stack cannot run (TE-only paths, DeepEP,
version bugs) is decided by the stack rules from the capability probe, not here.
"""

from autotune.core.contract import TrainableSupport

SUPPORT = TrainableSupport(
    name="megatron",
    requires_cuda=True,
    megatron_core_layers=True,
    own_process=True,
    # Its ranks are kept from one burst to the next (an H100 with TE, 2026-12-06,
    # bench/results/h100_kept_ranks_te_20261206/): after its release a burst leaves no memory
    # allocated, a TE-graph burst runs after another, and bring-up run again after it gives losses
    # as close to new processes' as theirs are to each other (0.0012 against 0.0009 at most).
    # A full-iteration graph needs megatron-core's FullCudaGraphWrapper around the whole
    # forward-backward, which this trainable's loop does not build.
    allowed={"cuda_graph_impl": frozenset({"none", "local", "transformer_engine"})},
    rank_imports=("transformer_engine.pytorch", "trainables.megatron.model", "megatron.core.distributed",
                  "megatron.core.optimizer", "megatron.core.pipeline_parallel"),
)
