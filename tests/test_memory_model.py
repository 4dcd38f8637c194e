"""The memory model: its terms move the way sharding, micro-batch, recompute and freezing move
memory; calibrated on reported peaks it predicts within its measured error; and the search
rejects configs it predicts over the limit before launch."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from autotune.core.knobs import complete_config
from autotune.core.model import model_preset
from autotune.memory_model import MIN_OBSERVATIONS, MemoryModel, memory_terms
from autotune.search.proposer import Proposer
from autotune.space import load_space, target_context

MODEL = model_preset("h200_small_moe_vlm")
H200 = load_space(Path("search_spaces/h200_single.yaml"))
GIB = 2**30


def terms(world_size: int = 8, **values):
    return memory_terms(complete_config({"moe_token_dispatcher_type": "alltoall", **values}), MODEL, world_size)


def test_terms_follow_the_knobs() -> None:
    base = terms()
    assert terms(micro_batch_size=2).decoder_activations == pytest.approx(2 * base.decoder_activations)
    selective = terms(recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
    full = terms(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert full.decoder_activations < selective.decoder_activations < base.decoder_activations
    frozen = terms(freeze_vision_model=True)
    assert frozen.static < base.static and frozen.vision_activations == 0 < base.vision_activations
    assert terms(expert_model_parallel_size=2).static < base.static
    assert terms(use_megatron_fsdp=True).static == pytest.approx(base.static / 8)
    assert terms(cuda_graph_impl="local", cuda_graph_scope=["moe_router", "moe_preprocess"]).decoder_activations \
        > base.decoder_activations


def peak(config, coefficients=(1.3, 0.4, 2 * GIB)) -> float:
    """A stand-in for reported peaks: 5 % over the counted static bytes, scaled activations, a base."""
    terms = memory_terms(config, MODEL, 1)
    return 1.05 * terms.static + float(terms.features() @ np.array(coefficients))


def test_calibration_predicts_within_its_error_and_rejects_over_the_limit() -> None:
    configs = list(H200.configs())
    random.Random(0).shuffle(configs)  # peaks arrive from configs spread over the space
    model = MemoryModel(MODEL, 1, limit_bytes=35 * GIB)
    for config in configs[:MIN_OBSERVATIONS - 1]:
        model.observe(config, peak(config))
    assert model.predict(configs[0]) is None and model.rejection(configs[0]) is None  # not calibrated yet
    rng = np.random.default_rng(0)
    for config in configs[MIN_OBSERVATIONS - 1:20]:
        model.observe(config, peak(config) * (1 + 0.02 * rng.standard_normal()))
    error = model.error()
    assert error is not None and error < 0.15
    for config in configs[20:]:
        assert abs(model.predict(config) - peak(config)) / peak(config) <= 0.15
    big = max(configs, key=peak)
    small = min(configs, key=peak)
    assert peak(big) > 35 * GIB * 1.2 > 35 * GIB > peak(small) * 1.2
    assert "over the 35.0 GiB limit" in model.rejection(big)
    assert model.rejection(small) is None


def test_the_search_rejects_configs_predicted_over_the_limit() -> None:
    memory = MemoryModel(MODEL, 1, limit_bytes=35 * GIB)
    proposer = Proposer(H200, target_context(H200), None, "t", sampler="random", seed=1, memory=memory)
    predicted = []
    for _ in range(80):
        proposal = proposer.propose()
        if proposal is None:
            break
        reported = peak(proposal.config)
        if reported > 35 * GIB:
            proposer.complete(proposal, "oom", None, peak_memory_bytes=None)
        else:
            proposer.complete(proposal, "ok", 1000.0, peak_memory_bytes=int(reported))
        predicted += [r for r in proposer.take_rejections() if "memory model" in r.reason]
    assert memory.calibrated and predicted
    assert all(peak(r.config) > 35 * GIB for r in predicted)
