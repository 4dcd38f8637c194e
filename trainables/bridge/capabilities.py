"""What the Megatron-Bridge trainable honours (plain data; importing it needs no Bridge).

Every knob goes to the user's recipe as the override ``autotune export`` writes for it; a value Bridge
cannot take is refused by the export (``ExportRefused``) or by Bridge's ``validate()`` before launch,
both the trial's ``invalid`` outcome. What the installed stack cannot run is the stack rules' call.
"""

from autotune.core.contract import TrainableSupport

SUPPORT = TrainableSupport(name="bridge", requires_cuda=True, megatron_core_layers=True, fresh_process=True)
