"""The architecture's two walls: the tuner never imports Megatron, trainables never import Optuna/Tune."""

from __future__ import annotations

import subprocess
import sys

TUNER_MODULES = [
    "autotune.knobs", "autotune.rules", "autotune.space", "autotune.campaign", "autotune.survey", "autotune.cli",
]
TRAINABLE_MODULES = ["trainables", "trainables.native.capabilities", "trainables.megatron.capabilities",
                     "trainables.megatron.config_mapping"]


def loaded_after_import(modules: list[str]) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_tuner_does_not_import_megatron() -> None:
    loaded = loaded_after_import(TUNER_MODULES)
    assert not {m for m in loaded if m == "megatron" or m.startswith("megatron.")}


def test_trainables_do_not_import_optuna_or_ray_tune() -> None:
    loaded = loaded_after_import(TRAINABLE_MODULES)
    assert not {m for m in loaded if m.split(".")[0] == "optuna" or m.startswith("ray.tune")}
