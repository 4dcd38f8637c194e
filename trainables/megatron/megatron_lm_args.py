"""Megatron-LM's own argument parser and ``validate_args``, fed the exports we write.

``megatron/training`` ships inside megatron-core's wheels from 0.17.1 on, and those wheels need
Python 3.12 (for 0.16.1 it comes from Megatron-LM's ``core_v0.16.1`` tag): this runs where they
import, the GPU machine, and its output is committed (``bench/results/megatron_lm_check/``). VLM
training goes through ``pretrain_vlm.py``, whose extra arguments (``--freeze-ViT``, ``--freeze-LM``)
are added by its ``add_vlm_extra_args``: its ``add_argument`` calls are read from the release's own
file (the script's module imports need a training environment) and passed to ``parse_args`` as the
script passes them, with the script's ``args_defaults`` to ``validate_args``.

Each case is parsed exactly as a launch would be (``sys.argv`` and ``WORLD_SIZE`` set, the real
``parse_args``), then validated; the result is the tool's message, or none. The flag table (every
option string with its operand count and choices) is written beside the results, so that CI, which
cannot import this Megatron-LM, holds every export to the same flags.

Usage: ``python -m trainables.megatron.megatron_lm_args CASES.json PRETRAIN_VLM.py OUT.json``
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

VLM_ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
"""What ``pretrain_vlm.py`` passes to ``pretrain`` as ``args_defaults``."""


def vlm_extra_args_provider(pretrain_vlm: Path) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """The arguments ``add_vlm_extra_args`` in a ``pretrain_vlm.py`` adds, read from its source (its
    ``add_argument`` calls take only literals and builtin types), as an ``extra_args_provider``."""
    tree = ast.parse(pretrain_vlm.read_text(), filename=str(pretrain_vlm))
    function = next((node for node in tree.body
                     if isinstance(node, ast.FunctionDef) and node.name == "add_vlm_extra_args"), None)
    if function is None:
        raise SystemExit(f"{pretrain_vlm}: no add_vlm_extra_args function")
    builtin_types = {"int": int, "float": float, "str": str}
    arguments = []
    for call in ast.walk(function):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            options = [ast.literal_eval(arg) for arg in call.args]
            settings = {keyword.arg: builtin_types[keyword.value.id] if isinstance(keyword.value, ast.Name)
                        else ast.literal_eval(keyword.value) for keyword in call.keywords}
            arguments.append((options, settings))

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group(title="vision language model specific arguments")
        for options, settings in arguments:
            group.add_argument(*options, **settings)
        return parser

    return provider


def flag_table(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """Every option string: how many operands it takes (argparse's ``nargs``, 0 for switches) and
    its choices, as strings."""
    table = {}
    for action in parser._actions:
        operands: int | str = 0 if action.nargs == 0 else (1 if action.nargs is None else action.nargs)
        for option in action.option_strings:
            table[option] = {
                "dest": action.dest,
                "operands": operands,
                "choices": None if action.choices is None else sorted(str(choice) for choice in action.choices),
            }
    return table


def validation_error(argv: list[str], world_size: int, provider: Callable) -> str | None:
    """Megatron-LM's verdict on a launch with ``argv`` over ``world_size`` ranks: ``None`` when
    ``parse_args`` and ``validate_args`` accept it, else their message."""
    from megatron.training.arguments import parse_args, validate_args

    saved_argv, saved_env = sys.argv, {key: os.environ.get(key) for key in ("WORLD_SIZE", "RANK")}
    sys.argv = ["pretrain_vlm.py", *argv]
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            args = parse_args(provider)
            validate_args(args, dict(VLM_ARGS_DEFAULTS))
        return None
    except SystemExit as exc:  # argparse's error, its message on stderr
        lines = errors.getvalue().strip().splitlines()
        return lines[-1] if lines else f"SystemExit: {exc.code}"
    except Exception as exc:  # the validators raise AssertionError, ValueError, RuntimeError, …
        return f"{type(exc).__name__}: {exc}".strip()
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    cases_path, pretrain_vlm, out = (Path(arg) for arg in sys.argv[1:4])
    import megatron.core
    import torch
    from megatron.training.arguments import add_megatron_arguments

    provider = vlm_extra_args_provider(pretrain_vlm)
    cases = json.loads(cases_path.read_text())
    started = time.monotonic()
    results = [{"key": case["key"], "error": validation_error(case["base"] + case["export"],
                                                              case["world_size"], provider)}
               for case in cases["cases"]]
    parser = provider(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    out.write_text(json.dumps({
        "contract": {
            "tool": "Megatron-LM megatron/training/arguments.py parse_args + validate_args, "
                    f"with add_vlm_extra_args from {pretrain_vlm.name}",
            "megatron_core": megatron.core.__version__, "megatron_training": str(Path(megatron.core.__file__).parents[1]),
            "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d"), "seconds": round(time.monotonic() - started, 1),
        },
        "megatron_core_target": cases["megatron_core"],
        "flags": flag_table(parser),
        "results": results,
    }, indent=1))
    rejected = sum(result["error"] is not None for result in results)
    print(f"{megatron.core.__version__}: {len(results)} exports, {rejected} rejected -> {out}")


if __name__ == "__main__":
    main()
