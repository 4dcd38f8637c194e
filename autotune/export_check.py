"""The exports we feed to Megatron-LM's and Megatron-Bridge's own parsers and validators.

A winner can be any config the rules accept, so the cases are drawn from every shipped space under
its own target: a set of accepted configs in which every pair of knob values that occurs together
in an accepted config occurs at least once (a pairwise cover: a value that only fails beside another
one is caught), each written as ``autotune export`` writes it — the knobs the space tunes, and every
knob (``--all``). The real tools run where they install (``trainables/megatron/megatron_lm_args.py``
on the GPU machine, Bridge 0.3 in the tests); ``tests/test_export_tools.py`` holds the committed
results to the cases this module computes today, so an export that changes is checked again.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path
from typing import Any, Iterator

from autotune.core.knobs import KNOBS, Config
from autotune.core.model import ModelSpec
from autotune.core.tool_flags import ExportRefused, bridge_overrides, megatron_lm_args
from autotune.export import Format
from autotune.rules import RuleContext
from autotune.space import SearchSpace, load_space, target_context
from autotune.survey import survey_space

SPACES_DIR = Path(__file__).resolve().parent.parent / "search_spaces"


@dataclass(frozen=True)
class ExportCase:
    """One export as the target tool receives it, with what the tool needs around it."""

    space: str
    world_size: int
    base: tuple[str, ...]
    """What the user's launch holds before the paste: for Megatron-LM the target model's flags; for
    a tuned-knobs export also every other knob at the value it was measured with (written by
    ``--all``), as the recipe the campaign tuned holds them."""
    export: tuple[str, ...]
    """What ``autotune export`` writes: flags, or Hydra overrides."""
    config: dict[str, Any]

    @property
    def key(self) -> str:
        """Identifies the case in committed results: the full argument list and the world size."""
        return f"{self.world_size} | {' '.join(self.base)} | {' '.join(self.export)}"

    def to_plain(self) -> dict[str, Any]:
        return {**asdict(self), "base": list(self.base), "export": list(self.export), "key": self.key}


def _pairs(config: Config) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    values = sorted((name, KNOBS[name].format(value)) for name, value in config.explicit().items())
    return set(combinations(values, 2))


def pairwise_cover(configs: list[Config], seed: int = 0) -> list[Config]:
    """Configs (in a seeded order) kept while they bring a knob-value pair not seen yet: every pair
    of values that occurs together in ``configs`` occurs in the result."""
    order = list(configs)
    random.Random(seed).shuffle(order)
    seen: set[tuple[tuple[str, str], tuple[str, str]]] = set()
    kept = []
    for config in order:
        pairs = _pairs(config)
        if not pairs <= seen:
            kept.append(config)
            seen |= pairs
    return kept


def megatron_lm_model_args(model: ModelSpec) -> list[str]:
    """The model part of a Megatron-LM command line for ``model`` (mock data, a null tokenizer):
    what ``validate_args`` needs besides the exported knobs."""
    args = [
        "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
        "--ffn-hidden-size", str(model.ffn_hidden_size), "--num-attention-heads", str(model.num_attention_heads),
        "--group-query-attention", "--num-query-groups", str(model.num_query_groups),
        "--seq-length", str(model.seq_length), "--max-position-embeddings", str(model.seq_length),
        "--num-experts", str(model.num_moe_experts), "--moe-router-topk", str(model.moe_router_topk),
        "--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size),
        "--vocab-size", str(model.vocab_size), "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--train-iters", "10", "--lr", "1e-4", "--bf16",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
    ]
    if model.kv_channels is not None:
        args += ["--kv-channels", str(model.kv_channels)]
    return args


def bridge_workload_overrides(space: SearchSpace, world_size: int) -> list[str]:
    """The workload part of a Bridge launch: a global batch every config of ``space`` splits over
    ``world_size`` ranks (the world times every micro-batch size). Megatron-LM derives its global
    batch from MBS × DP when none is given; a Bridge recipe fixes one (32 in the Qwen3-VL recipes),
    which 64 ranks cannot split, and a campaign that fixed none leaves the user's own in place."""
    return [f"train.global_batch_size={world_size * math.lcm(*space.choices('micro_batch_size'))}"]


def accepted_configs(spaces_dir: Path = SPACES_DIR) -> Iterator[tuple[SearchSpace, RuleContext, list[Config]]]:
    """Each shipped space, its target's rule context, and the configs the rules accept there: the
    configs a campaign on it can make a winner. Spaces for the ``bridge`` trainable are left out:
    their winner's export is the overrides its trial ran, which the user's own Megatron-Bridge
    validated before the trial launched (``trainables/bridge/recipe.py``). Cuts of another space
    are left out too: each of their configs is their parent's (``autotune/space.py``)."""
    for path in sorted(spaces_dir.glob("*.yaml")):
        space = load_space(path)
        if space.target.trainable == "bridge" or space.cut_of is not None:
            continue
        context = target_context(space)
        yield space, context, survey_space(space, context).accepted


def export_cases(fmt: Format, megatron_core_version: str, spaces_dir: Path = SPACES_DIR) -> Iterator[ExportCase]:
    """Every shipped space's pairwise cover, exported in ``fmt`` for ``megatron_core_version``, tuned
    knobs and ``--all``; identical exports once. Configs the export refuses are left out (the tests
    check the refusals by their reasons)."""
    seen: set[str] = set()
    write = bridge_overrides if fmt == "bridge" else megatron_lm_args
    for space, context, accepted in accepted_configs(spaces_dir):
        base_args = tuple(megatron_lm_model_args(context.model) if fmt == "megatron-lm"
                          else bridge_workload_overrides(space, context.world_size))
        for config in pairwise_cover(accepted):
            try:
                every_knob = tuple(write(config, megatron_core_version, None))
                tuned = tuple(write(config, megatron_core_version, list(space.tuned)))
            except ExportRefused:
                continue
            for base, export in ((base_args, every_knob), (base_args + every_knob, tuned)):
                case = ExportCase(space=space.name, world_size=context.world_size, base=base,
                                  export=export, config=config.to_plain())
                if case.key not in seen:
                    seen.add(case.key)
                    yield case


def control_cases(fmt: Format) -> list[ExportCase]:
    """Launches the tool must reject (a flag or field it does not have; a tensor-parallel size
    that does not divide the world): the proof that a check run can say no."""
    model = target_context(load_space(sorted(SPACES_DIR.glob("*.yaml"))[0])).model
    model_args = tuple(megatron_lm_model_args(model)) if fmt == "megatron-lm" else ()
    exports = ((("--freeze-vision-projection",), ("--tensor-model-parallel-size", "3")) if fmt == "megatron-lm"
               else (("model.freeze_vision_encoder=true",), ("model.tensor_model_parallel_size=3",)))
    return [ExportCase(space="control", world_size=2, base=model_args, export=export, config={})
            for export in exports]


def main(argv: list[str]) -> None:
    """``python -m autotune.export_check FORMAT VERSION OUT.json``: the cases, for the machine
    where the real tool runs."""
    import json

    fmt, version, out = argv
    cases = [case.to_plain() for case in [*export_cases(fmt, version), *control_cases(fmt)]]  # type: ignore[arg-type]
    Path(out).write_text(json.dumps({"format": fmt, "megatron_core": version, "cases": cases}))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
