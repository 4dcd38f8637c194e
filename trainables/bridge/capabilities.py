"""What the Megatron-Bridge trainable honours (plain data; importing it needs no Bridge).

Every knob goes to the user's recipe as the override ``autotune export`` writes for it; a value Bridge
cannot take is refused by the export (``ExportRefused``) or by Bridge's ``validate()`` before launch,
both the trial's ``invalid`` outcome. What the installed stack cannot run is the stack rules' call.
"""

from autotune.core.contract import TrainableSupport

SUPPORT = TrainableSupport(
    name="bridge", requires_cuda=True, megatron_core_layers=True, own_process=True, kept_ranks=False,
    # Not Bridge itself: it imports huggingface_hub, which must first see the burst's offline
    # checkpoints (``recipe.go_offline``).
    rank_imports=("transformer_engine.pytorch", "megatron.core.models.gpt", "megatron.core.distributed",
                  "megatron.core.optimizer", "megatron.core.pipeline_parallel"),
)
