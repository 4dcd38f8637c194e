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
    # Its bursts left the model and optimizer allocated (19.6 GiB after bring-up on an H100 and an
    # H200, bench/results/h200_kept_ranks_20261206/): megatron-core's token dispatcher kept the last
    # step's autograd graph. Its release drops that graph since (65 MiB left on an H100,
    # bench/results/h100_leak_fix_20261206/); kept once a GPU run also shows the same losses and a
    # TE-graph burst after another (bench/reused_process.py).
    kept_ranks=False,
    # A full-iteration graph needs megatron-core's FullCudaGraphWrapper around the whole
    # forward-backward, which this trainable's loop does not build.
    allowed={"cuda_graph_impl": frozenset({"none", "local", "transformer_engine"})},
    rank_imports=("transformer_engine.pytorch", "trainables.megatron.model", "megatron.core.distributed",
                  "megatron.core.optimizer", "megatron.core.pipeline_parallel"),
)
