"""The memory model: its terms move the way sharding, micro-batch, recompute and freezing move
memory; calibrated on reported peaks it predicts within its measured error; and the search
rejects configs it predicts over the limit before launch."""

from __future__ import annotations

import dataclasses
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


def terms(world_size: int = 8, global_batch_size: int | None = None, **values):
    return memory_terms(complete_config({"moe_token_dispatcher_type": "alltoall", **values}), MODEL, world_size,
                        global_batch_size)


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


def test_moe_act_recompute_saves_between_none_and_moe() -> None:
    attention_only = terms(recompute_granularity="selective", recompute_modules=["core_attn"])
    with_act = terms(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"])
    with_moe = terms(recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
    assert with_moe.decoder_activations < with_act.decoder_activations < attention_only.decoder_activations
    assert with_act.static == attention_only.static


def test_fp8_adds_a_byte_per_decoder_linear_parameter() -> None:
    bf16, fp8 = terms(), terms(fp8="hybrid", fp8_recipe="tensorwise")
    h, layers, experts = MODEL.hidden_size, MODEL.num_layers, MODEL.num_moe_experts
    assert MODEL.first_k_dense_layers == 0 and MODEL.moe_shared_expert_intermediate_size in (None, 0)
    head_dim = MODEL.kv_channels or h // MODEL.num_attention_heads
    groups = MODEL.num_query_groups or MODEL.num_attention_heads
    attention = h * head_dim * (2 * MODEL.num_attention_heads + 2 * groups)
    expert_weights = experts * 3 * h * MODEL.moe_ffn_hidden_size
    assert fp8.static - bf16.static == pytest.approx(layers * (attention + expert_weights))
    assert fp8.decoder_activations == bf16.decoder_activations


def test_accumulation_keeps_one_micro_batch_without_a_pipeline_and_fills_it_with_one() -> None:
    """Without PP each micro-batch's backward frees its activations: the global batch changes
    nothing. With PP 4 the first stage holds min(4, micro-batches) of them; with VPP 2 the
    interleaved schedule's 11 warm-up-and-first chunks, half a stage's layers each."""
    assert terms(global_batch_size=64) == terms(global_batch_size=8) == terms()
    pipeline = {"pipeline_model_parallel_size": 4}
    two, four, eight = (terms(global_batch_size=gbs, **pipeline).decoder_activations for gbs in (4, 8, 16))
    assert two == pytest.approx(four / 2) and eight == pytest.approx(four)
    assert terms(**pipeline).decoder_activations == pytest.approx(four)  # no global batch: PP micro-batches
    vision = terms(global_batch_size=4, **pipeline).vision_activations
    assert vision == pytest.approx(terms(global_batch_size=8, **pipeline).vision_activations / 2)
    interleaved = {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2}
    assert terms(global_batch_size=8, **interleaved).decoder_activations == pytest.approx(four)
    assert terms(global_batch_size=32, **interleaved).decoder_activations == pytest.approx(four * 5.5 / 4)


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
    assert "over the 35.00 GiB limit" in model.rejection(big)
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


def test_before_calibration_only_a_twin_at_another_micro_batch_size_rejects() -> None:
    """One peak cannot calibrate the fit, but the same config at another micro-batch size scales it:
    the memory-frontier walk's MBS 8 after bring-up's MBS 1 (seen on the H200 with the ViT trained:
    MBS 8, 4 and 2 with full recompute all ran out of a 35 GiB cap after MBS 1 peaked at 25.4 GiB)."""
    memory = MemoryModel(MODEL, 1, limit_bytes=35 * GIB, global_batch_size=8)
    full = {"moe_token_dispatcher_type": "alltoall", "recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1}
    bring_up = complete_config({**full, "micro_batch_size": 1})
    assert memory.rejection(bring_up) is None  # nothing seen yet
    memory.observe(bring_up, 25.4 * GIB)
    assert not memory.calibrated and memory.predict(bring_up) is None
    eight = complete_config({**full, "micro_batch_size": 8})
    assert "scaled from the same config's peak at another micro-batch size" in memory.rejection(eight)
    assert memory.scaled(bring_up) == pytest.approx(25.4 * GIB)
    two = complete_config({**full, "micro_batch_size": 2})
    assert memory.rejection(two) is None and 30 * GIB < memory.scaled(two) < 40 * GIB
    selective = complete_config({"moe_token_dispatcher_type": "alltoall", "micro_batch_size": 4,
                                 "recompute_granularity": "selective", "recompute_modules": ["core_attn"],
                                 "freeze_vision_model": True})
    assert memory.scaled(selective) is None and memory.rejection(selective) is None  # no twin: no guess


def test_the_floor_rejects_from_the_first_proposal_what_its_counted_bytes_alone_exceed() -> None:
    """MBS 8 without recompute, the ViT frozen: 15.7 GiB of weights and optimizer states and 39.3 GiB
    of decoder activations counted, before any peak (it ran out of the 35 GiB cap on the H200). MBS 4
    with attention recomputed is counted at 19.3 GiB and is not rejected; no peak moves the floor."""
    memory = MemoryModel(MODEL, 1, limit_bytes=35 * GIB, global_batch_size=8)
    none = complete_config({"moe_token_dispatcher_type": "alltoall", "micro_batch_size": 8, "freeze_vision_model": True})
    selective = complete_config({"moe_token_dispatcher_type": "alltoall", "micro_batch_size": 4,
                                 "freeze_vision_model": True, "recompute_granularity": "selective",
                                 "recompute_modules": ["core_attn"]})
    assert memory.floor(none) == pytest.approx(54.95 * GIB, rel=1e-3)
    assert memory.floor(selective) == pytest.approx(19.33 * GIB, rel=1e-3)
    assert "weights, optimizer states and decoder activations alone" in memory.rejection(none)
    assert memory.rejection(selective) is None
    memory.observe(selective, 24.3 * GIB)
    assert memory.floor(none) == pytest.approx(54.95 * GIB, rel=1e-3)


@pytest.mark.parametrize("table", ["bench/data/h200_megatron_vlm.jsonl", "bench/data/h200_te_vlm.jsonl",
                                   "bench/data/h100_te_grid.jsonl", "bench/data/cpu_native_vlm_memory.jsonl"])
def test_no_recorded_peak_lies_below_the_floor_the_other_peaks_give(table: str) -> None:
    """The floor rejects only what cannot fit: on every table recorded under a memory limit, each
    config that ran peaked above its floor less the margin a rejection allows."""
    from autotune.campaign import load_campaign
    from autotune.core.tables import load_table
    from autotune.memory_model import MIN_MARGIN
    from autotune.search_benchmark import recorded_workload

    recorded = load_table(Path(table))
    campaign = load_campaign(Path(next(iter(recorded.rows.values())).contract["campaign"]), recorded_workload(recorded))
    ran = [(config, row.peak_memory_gib * GIB) for config, row in recorded.rows.items() if row.outcome == "ok"]
    memory = campaign.memory_model(None)
    assert ran and all(memory.floor(config) * (1 - MIN_MARGIN) <= reported for config, reported in ran)


def test_the_limit_is_the_counted_device_memory_on_the_cpu_and_the_capped_gpu_elsewhere() -> None:
    """The CPU demo's ranks count their tensors against 0.27 GiB and report peaks in that count, so
    its memory model has a limit to reject against; the H200 campaign's is its cap's share."""
    from autotune.campaign import load_campaign
    from autotune.engine.driver import memory_limit_bytes

    demo = load_campaign(Path("campaigns/cpu_demo.yaml"))
    assert memory_limit_bytes(demo, []) == int(0.27 * GIB)
    uncounted = dataclasses.replace(demo, spec=demo.spec.model_copy(update={
        "hardware": demo.spec.hardware.model_copy(update={"cpu_device_memory_gib": None})}))
    assert memory_limit_bytes(uncounted, []) is None
    h200 = load_campaign(Path("campaigns/h200_single.yaml"))
    assert memory_limit_bytes(h200, [{"device_memory_bytes": 140 * GIB}]) == pytest.approx(0.25 * 140 * GIB)
    assert memory_limit_bytes(h200, []) is None
