"""The architecture's layers and walls, stated once in pyproject.toml (``[tool.importlinter]``).

Import Linter reads every import statement of ``autotune/`` and ``trainables/`` — those inside
functions, each CLI command's lazy ones included — and holds them to the layers (CLI, tuner parts,
trainables, the shared ``autotune.core``), the walls (the tuner never imports Megatron or TE,
trainables never Optuna or Ray) and to no import circling back. What a static reading cannot see,
a module the trainable registry loads by name, a fresh interpreter catches: it imports every
module of each side and names the first one after which a forbidden package was loaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

WALK = """
import importlib, pkgutil, sys
side, forbidden = sys.argv[1], set(sys.argv[2].split(","))
package = importlib.import_module(side)
culprits = {}
for info in pkgutil.walk_packages(package.__path__, side + "."):
    if info.name.endswith(".__main__"):  # runs the CLI
        continue
    importlib.import_module(info.name)
    culprits.update({name: info.name for name in forbidden - set(culprits) if name in sys.modules})
print(culprits)
"""


def test_import_linter_contracts_hold() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports; "
         "raise SystemExit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("side", "forbidden"),
    [
        # the tuner starts without torch (autotune validate answers in half a second), Megatron or TE
        ("autotune", "megatron,transformer_engine,torch"),
        ("autotune.core", "torch,ray,optuna,megatron,transformer_engine"),
        ("trainables", "optuna,ray"),
    ],
)
def test_every_module_of_a_side_imports_without_what_it_must_not(side: str, forbidden: str) -> None:
    result = subprocess.run([sys.executable, "-c", WALK, side, forbidden], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "{}", f"forbidden package: first loaded after {result.stdout}"
