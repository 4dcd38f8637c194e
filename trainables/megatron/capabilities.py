"""What the megatron-core trainable honours (plain data; importing it needs no megatron).

Every knob maps to megatron-core; what the installed stack cannot run (TE-only paths, DeepEP,
version bugs) is decided by the stack rules from the capability probe, not here.
"""

from autotune.core.contract import TrainableSupport

SUPPORT = TrainableSupport(name="megatron", requires_cuda=True, megatron_core_layers=True, fresh_process=True)
