"""The native MoE VLM burst: each knob measurably does what it says, and every outcome is real."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from autotune.core.contract import (
    BurstRequest, Contract, DataSpec, Evidence, InvalidConfig, StepRecord, StepReport, TimedPart,
)
from autotune.core.knobs import complete_config
from autotune.core.model import model_preset
from trainables.data.loader import ImageSettings, PackedVLMDataset
from trainables.flops import CONVENTION
from trainables import zygote
from trainables.launch import WORLD_KEPT, run_local
from trainables.measurement import code_version
from trainables.native.burst import native_contract, run_rank
from trainables.native.cuda_graphs import apply_cuda_graphs
from trainables.native.model import MoEVLM
from trainables.native.parallelize import ParallelGroups, apply_expert_parallel
from trainables.native.recompute import apply_recompute
from trainables.steps import LocalMeasures, StepCounts, finish_step

SPEC = model_preset("cpu_tiny_moe_vlm", {"seq_length": 256})
IMAGES = ImageSettings(14, 2, SPEC.images.min_pixels, SPEC.images.max_pixels)
BASE = {"moe_token_dispatcher_type": "alltoall"}


def batch_from(folder: Path, rank: int = 0, micro_batch_size: int = 1):
    return next(iter(PackedVLMDataset(folder, IMAGES, SPEC.seq_length, micro_batch_size, rank=rank, world_size=2)))


def forward(model: MoEVLM, batch):
    return model(*batch.model_inputs())


def build(config_values: dict) -> MoEVLM:
    torch.manual_seed(0)
    model = MoEVLM(SPEC)
    config = complete_config({**BASE, **config_values})
    model.freeze(config.freeze_vision_model, config.freeze_vision_projection)
    apply_recompute(model, config)
    return model


def saved_activation_bytes(model: MoEVLM, batch) -> int:
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(model, batch).loss.backward()
    return total


RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]},
    "full": {"recompute_granularity": "full"},
}


def test_recompute_lowers_saved_activations(photo_shards: Path) -> None:
    batch = batch_from(photo_shards)
    saved = {name: saved_activation_bytes(build(values), batch) for name, values in RECOMPUTE.items()}
    assert saved["full"] < saved["selective"] < saved["none"]


def moe_forward_calls(model: MoEVLM) -> list:
    """Counts forward passes of the last MoE layer (a pre-hook: non-reentrant recompute stops as
    soon as it has what backward needs, so a post-hook may never fire during recompute)."""
    calls: list = []
    moe = model.decoder_layers()[-1].moe
    (moe.inner if hasattr(moe, "inner") else moe).register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name", ["none", "selective", "full"])
def test_recompute_runs_the_wrapped_forward_again_in_backward(photo_shards: Path, name: str) -> None:
    model = build(RECOMPUTE[name])
    calls = moe_forward_calls(model)
    out = forward(model, batch_from(photo_shards))
    assert len(calls) == 1
    out.loss.backward()
    assert len(calls) == (1 if name == "none" else 2)


def test_frozen_vision_has_no_gradients_and_forward_only_flops(photo_shards: Path) -> None:
    batch = batch_from(photo_shards)
    model = build({"freeze_vision_model": True})
    forward(model, batch).loss.backward()
    assert all(p.grad is None for p in model.vision.parameters())
    assert all(p.grad is not None for p in model.projector.parameters())
    from trainables.flops import step_flops

    frozen = step_flops(SPEC, batch.segment_ids, batch.image_grids, True, False)
    trainable = step_flops(SPEC, batch.segment_ids, batch.image_grids, False, False)
    assert 0 < frozen < trainable


EP_WORKER = r"""
import pickle, sys, torch, torch.distributed as dist
from datetime import timedelta
from autotune.core.knobs import complete_config
from trainables.native.model import MoEVLM
from trainables.native.parallelize import make_groups, apply_expert_parallel
rank, rendezvous, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
spec, batches = pickle.load(open(path, "rb"))
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
torch.manual_seed(0)
model = MoEVLM(spec)
config = complete_config({"moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": 2})
groups = make_groups(config, 2, rank)
apply_expert_parallel(model, groups)
b = batches[rank]
out = model(*b.model_inputs())
out.loss.backward()
print("LOSS", rank, repr(out.loss.item()), model.decoder_layers()[-1].moe.experts.local_count)
dist.destroy_process_group()
"""


def test_expert_parallel_over_two_gloo_ranks_matches_one_rank(photo_shards: Path, tmp_path: Path) -> None:
    batches = [batch_from(photo_shards, rank=r) for r in (0, 1)]
    expected = []
    for batch in batches:
        torch.manual_seed(0)
        expected.append(forward(MoEVLM(SPEC), batch).loss.item())
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps((SPEC, batches)))
    rendezvous = str(tmp_path / "rendezvous")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", EP_WORKER, str(r), rendezvous, str(payload)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in procs]
    losses = {}
    for (stdout, stderr), proc in zip(outputs, procs):
        assert proc.returncode == 0, stderr[-3000:]
        _, rank, loss, local = next(line for line in stdout.splitlines() if line.startswith("LOSS")).split()
        losses[int(rank)] = float(loss)
        assert int(local) == SPEC.num_moe_experts // 2
    assert losses[0] == pytest.approx(expected[0], rel=1e-5)
    assert losses[1] == pytest.approx(expected[1], rel=1e-5)


def request(folder: Path, steps: int = 3, world_size: int = 1, spec=SPEC, **values) -> BurstRequest:
    return BurstRequest(config=complete_config({**BASE, **values}), model=spec, data=DataSpec(str(folder)),
                        steps=steps, world_size=world_size, data_workers=0)


def test_burst_records_every_step_with_contract(photo_shards: Path) -> None:
    result = run_local(request(photo_shards, steps=4, freeze_vision_model=True))
    assert result.outcome == "ok", result.error
    assert [r.step for r in result.records] == [0, 1, 2, 3]
    for record in result.records:
        assert record.useful_tokens == record.loss_tokens + record.image_tokens > 0
        assert record.step_seconds >= record.data_wait_seconds + record.vision_seconds
        assert record.model_flops > 0 and record.peak_memory_bytes > 0
    assert result.contract.data.realism == "real"
    assert result.contract.precision == "fp32" and result.contract.flops_convention
    assert result.evidence.frozen_vision_params_with_grad == 0


def test_oom_is_an_outcome_not_a_crash(photo_shards: Path, monkeypatch) -> None:
    def exhausted(*args, **kwargs):  # a test double of an allocator that has run out
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(MoEVLM, "forward", exhausted)
    result = run_local(request(photo_shards))
    assert result.outcome == "oom" and "Tried to allocate" in result.error and result.records == ()
    # With no step to send its set-up with, the burst says where its seconds went, to the OOM
    parts = [part.name for part in result.before_first_step]
    assert parts[0] == "data loader" and "model" in parts and parts[-1] == "the first step, until out of memory"


def test_config_the_stack_rejects_is_invalid(photo_shards: Path) -> None:
    tiny_vocab = model_preset("cpu_tiny_moe_vlm", {"vocab_size": 100})
    result = run_local(request(photo_shards, spec=tiny_vocab))
    assert result.outcome == "invalid" and "vocab_size 100" in result.error


def test_unexpected_error_is_failed_with_traceback(photo_shards: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(MoEVLM, "forward", broken)
    result = run_local(request(photo_shards))
    assert result.outcome == "failed" and "Traceback" in result.error and "kernel exploded" in result.error


def test_a_value_error_while_building_is_failed_with_traceback_not_invalid(photo_shards: Path, monkeypatch) -> None:
    """Only :class:`InvalidConfig` is infeasible: a ``ValueError`` from a bug in the build is
    ``failed``, so the study retries the config instead of taking it for one that cannot run."""

    def buggy_freeze(self, *args):
        raise ValueError("a bug in the build path")

    monkeypatch.setattr(MoEVLM, "freeze", buggy_freeze)
    result = run_local(request(photo_shards))
    assert result.outcome == "failed", result.error
    assert "Traceback" in result.error and "ValueError: a bug in the build path" in result.error


def test_cuda_graphs_on_the_cpu_are_invalid_with_the_reason(photo_shards: Path) -> None:
    # The rules reject this config before launch; the runner, called directly, refuses it itself.
    result = run_rank(request(photo_shards, cuda_graph_impl="local", cuda_graph_scope=["attn"]), torch.device("cpu"))
    assert result.outcome == "invalid" and result.records == ()
    assert result.error == "cuda_graph_impl=local needs a CUDA device; this rank runs on cpu"


def test_an_ep_size_that_does_not_divide_the_ranks_is_invalid(photo_shards: Path) -> None:
    result = run_rank(request(photo_shards, expert_model_parallel_size=2), torch.device("cpu"))
    assert result.outcome == "invalid"
    assert result.error == "expert_model_parallel_size=2 does not divide the burst's 1 ranks"


def test_configs_the_native_model_cannot_build_raise_invalid_config() -> None:
    graphs_with_fsdp2 = complete_config({**BASE, "cuda_graph_impl": "local", "cuda_graph_scope": ["attn"],
                                         "use_torch_fsdp2": True})
    with pytest.raises(InvalidConfig, match="cuda_graph_impl=local cannot run with use_torch_fsdp2"):
        apply_cuda_graphs(MoEVLM(SPEC), graphs_with_fsdp2, probe_forward=lambda: None)
    with pytest.raises(InvalidConfig, match="8 experts cannot be spread evenly over expert_model_parallel_size=3"):
        apply_expert_parallel(MoEVLM(SPEC), ParallelGroups(world_size=3, rank=0, ep_size=3, ep_group=None,
                                                           expert_dp_group=None))


def test_a_rank_that_cannot_start_reports_why(photo_shards: Path, tmp_path: Path) -> None:
    # Ranks forked from a zygote already running (a campaign's), whatever ran in this process before.
    address = str(tmp_path / "zygote.sock")
    process = zygote.start(address)
    try:
        result = run_local(request(photo_shards, world_size=2), trainable="no_such_trainable", warm_ranks=address)
    finally:
        process.kill()
        process.wait()
    assert result.outcome == "failed"
    assert "could not start" in result.error and "unknown trainable 'no_such_trainable'" in result.error


@pytest.mark.parametrize("world_size", [1, 2])
def test_reporter_sees_every_step_and_prunes_the_burst(photo_shards: Path, world_size: int) -> None:
    seen = []
    result = run_local(request(photo_shards, steps=6, world_size=world_size),
                       reporter=lambda report: seen.append(report) or len(seen) < 2)
    assert result.outcome == "pruned" and len(result.records) == 2
    assert [r.record for r in seen] == list(result.records)  # the caller saw exactly the records kept
    # The first report carries the contract, every report the evidence: a caller that kills the
    # burst instead of letting it return still holds both.
    assert seen[0].contract is not None and seen[0].contract.config == result.contract.config
    assert seen[1].contract is None and seen[1].evidence.checks == result.evidence.checks
    # Ranks in processes time the burst's end, from the last verdict to their exit (one in-process rank does not)
    assert [part.name for part in result.teardown] == ([] if world_size == 1 else [
        "the trainable's end (its result, release)", WORLD_KEPT, "the ranks' exit"])
    assert all(part.seconds >= 0 for part in result.teardown)


@pytest.mark.parametrize("world_size", [1, 2])
def test_cpu_memory_cap_turns_a_too_large_step_into_oom(photo_shards: Path, world_size: int) -> None:
    capped = run_local(replace(request(photo_shards, steps=2, world_size=world_size, micro_batch_size=4),
                               cpu_memory_cap_bytes=8 * 2**20))
    assert capped.outcome == "oom", capped.error
    assert "can't allocate memory" in capped.error
    roomy = run_local(replace(request(photo_shards, steps=2, world_size=world_size), cpu_memory_cap_bytes=2**33))
    assert roomy.outcome == "ok", roomy.error


def test_evidence_checks_every_verified_knob(photo_shards: Path) -> None:
    result = run_local(request(photo_shards, steps=2, recompute_granularity="selective",
                               recompute_modules=["core_attn"], freeze_vision_model=True))
    assert result.outcome == "ok", result.error
    assert result.evidence.checks and all(result.evidence.checks.values()), result.evidence


@pytest.mark.parametrize(
    "values",
    [
        {"expert_model_parallel_size": 2, "micro_batch_size": 2},
        {"use_torch_fsdp2": True, "recompute_granularity": "full", "freeze_vision_model": True},
    ],
    ids=["ep2-ddp", "fsdp2-full-frozen"],
)
def test_two_rank_bursts(photo_shards: Path, values: dict) -> None:
    result = run_local(request(photo_shards, steps=3, world_size=2, **values))
    assert result.outcome == "ok", result.error
    expected = "FSDPMoEVLM" if values.get("use_torch_fsdp2") else "DistributedDataParallel"
    assert result.evidence.data_parallel == expected
    assert result.evidence.ep_group_size == values.get("expert_model_parallel_size", 1)
    assert result.contract.shapes.global_batch_size == 2 * values.get("micro_batch_size", 1)


def test_a_step_accumulates_the_global_batch_over_two_gloo_ranks(photo_shards: Path) -> None:
    # GBS 8 on 2 replicas: MBS 1 accumulates 4 micro-batches per rank, MBS 4 runs 1; both train on
    # the same 8 samples per optimizer step, so their first losses agree.
    first_losses = {}
    for micro_batch_size in (1, 4):
        burst = replace(request(photo_shards, steps=2, world_size=2, micro_batch_size=micro_batch_size),
                        global_batch_size=8)
        result = run_local(burst)
        assert result.outcome == "ok", result.error
        assert result.contract.shapes.num_microbatches == 8 // (micro_batch_size * 2)
        assert result.contract.shapes.global_batch_size == 8
        assert [record.samples for record in result.records] == [8, 8]
        first_losses[micro_batch_size] = result.records[0].loss
    assert first_losses[1] == pytest.approx(first_losses[4], rel=0.02)


def test_a_global_batch_the_micro_batches_do_not_divide_is_invalid_with_the_numbers(photo_shards: Path) -> None:
    burst = replace(request(photo_shards, world_size=2, micro_batch_size=4), global_batch_size=12)
    result = run_local(burst)
    assert result.outcome == "invalid"
    assert "global batch of 12 samples" in result.error and "micro_batch_size 4 × data-parallel 2 = 8" in result.error


# -- the end of a step, shared with the megatron trainable ------------------------------------------


@dataclass
class OneRank:
    """A run on one CPU rank, as :func:`finish_step` sees it."""

    device: torch.device = torch.device("cpu")
    rank: int = 0
    world_size: int = 1
    observed: Evidence = field(default_factory=lambda: Evidence(checks={"recompute_granularity": True},
                                                                 recompute_calls=3))
    build_phases: tuple[TimedPart, ...] = (TimedPart("model", 0.5),)

    def evidence(self) -> Evidence:
        return self.observed

    def contract(self) -> Contract:
        return Contract(trainable="test")


def test_finish_step_on_one_rank_assembles_the_record_from_local_measures() -> None:
    # No process group exists here: one rank must need no collective.
    counts = StepCounts(useful_tokens=300, image_tokens=100, loss_tokens=200, samples=3, model_flops=1.5e9,
                        skipped_samples=1)
    local = LocalMeasures(step_seconds=2.0, data_wait_seconds=0.25, vision_seconds=0.5, projector_seconds=0.125,
                          peak_memory_bytes=123, counts=counts, loss=2.5)
    reports: list[StepReport] = []
    before = time.time()
    record, stop = finish_step(OneRank(), 0, local, lambda report: reports.append(report) or True)
    assert record == StepRecord(
        step=0, step_seconds=2.0, data_wait_seconds=0.25, vision_seconds=0.5, projector_seconds=0.125,
        decoder_seconds=1.125, useful_tokens=300, image_tokens=100, loss_tokens=200, samples=3, model_flops=1.5e9,
        peak_memory_bytes=123, loss=2.5, skipped_samples=1,
    )
    assert not stop
    # the build, with the first step, and when this rank began it: its own step time before now
    began_at = reports[0].began_at
    assert began_at is not None and before - 2.0 <= began_at <= time.time() - 2.0
    assert reports == [StepReport(record, OneRank().observed, Contract(trainable="test"),
                                  build_phases=(TimedPart("model", 0.5),), began_at=began_at)]
    # After step 0 no contract; the reporter's False stops; a rank without a loss reports 0.
    quiet = LocalMeasures(step_seconds=1.0, data_wait_seconds=0.0, vision_seconds=0.0, projector_seconds=0.0,
                          peak_memory_bytes=1)
    record, stop = finish_step(OneRank(), 1, quiet, lambda report: reports.append(report) and False)
    assert stop and reports[1].contract is None
    assert (record.step, record.loss, record.useful_tokens, record.decoder_seconds) == (1, 0.0, 0, 1.0)
    assert finish_step(OneRank(), 2, quiet, None)[1] is False


STEP_WORKER = r"""
import json, sys, torch, torch.distributed as dist
from dataclasses import asdict
from datetime import timedelta
from autotune.core.contract import Contract, Evidence
import trainables.steps
from trainables.gpu_clock import ClockReading
from trainables.steps import LocalMeasures, StepCounts, finish_step
rank, rendezvous = int(sys.argv[1]), sys.argv[2]
# What NVML would read on a GPU: rank 1's clock held down by its power cap.
trainables.steps.read_clock = lambda device: [ClockReading(1980.0, ()), ClockReading(1755.0, ("sw_power_cap",))][rank]
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
class Run:
    device, rank, world_size, build_phases = torch.device("cpu"), rank, 2, ()
    def evidence(self): return Evidence()
    def contract(self): return Contract(trainable="test")
# As megatron's ranks: rank 0 counts the data and computes no loss, rank 1 the reverse, and is slower.
local = [LocalMeasures(1.0, 0.5, 0.25, 0.125, 200, counts=StepCounts(10, 4, 6, 2, 1e6, 1)),
         LocalMeasures(2.0, 0.5, 0.25, 0.25, 100, loss=3.0)][rank]
record, stop = finish_step(Run(), 0, local, (lambda report: False) if rank == 0 else None)
print("STEP", json.dumps([asdict(record), stop]))
dist.destroy_process_group()
"""


def test_finish_step_reduces_over_ranks_and_stops_them_together(tmp_path: Path) -> None:
    rendezvous = str(tmp_path / "rendezvous")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", STEP_WORKER, str(r), rendezvous], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(next(line for line in stdout.splitlines() if line.startswith("STEP"))[5:]))
    assert results[0] == results[1]  # every rank holds the same record and the same verdict
    record, stop = results[0]
    assert stop  # rank 0's reporter said stop; rank 1 has none
    # Times of the slowest rank, whole; counts summed; the fullest rank's peak; the lowest clock and
    # what held any rank's down; the loss averaged over the one rank that computed it.
    assert (record["step_seconds"], record["data_wait_seconds"], record["projector_seconds"],
            record["decoder_seconds"]) == (2.0, 0.5, 0.25, 1.0)
    assert (record["useful_tokens"], record["image_tokens"], record["loss_tokens"], record["samples"],
            record["model_flops"], record["skipped_samples"]) == (10, 4, 6, 2, 1e6, 1)
    assert record["peak_memory_bytes"] == 200 and record["loss"] == 3.0
    assert (record["sm_clock_mhz"], record["clock_held_by"]) == (1755.0, ["sw_power_cap"])


# -- the measurement contract ---------------------------------------------------------------------

NATIVE_CONTRACT_KEYS = {
    "": {"trainable", "versions", "hardware", "model", "data", "precision", "shapes", "timing", "flops_convention",
         "config"},
    "versions": {"python", "torch", "autotune"},
    "hardware": {"device", "accelerator", "world_size", "cpu_threads_per_rank"},
    "data": {"folder", "realism", "tokenizer"},
    "shapes": {"micro_batch_size", "seq_length", "data_parallel", "global_batch_size", "expert_parallel",
               "num_microbatches"},
}
"""The keys of the native contract's JSON as the trainable wrote them before contracts were typed, the
micro-batches per step since the workload fixes a global batch, and our code's version since
2026-12-07."""


def test_native_contract_json_has_exactly_the_keys_it_always_had(tmp_path: Path) -> None:
    burst = request(tmp_path, world_size=2, micro_batch_size=4, expert_model_parallel_size=2)
    written = native_contract(burst, torch.device("cpu")).to_json()
    assert {part: set(written[part] if part else written) for part in NATIVE_CONTRACT_KEYS} == NATIVE_CONTRACT_KEYS
    assert written["trainable"] == "native" and written["precision"] == "fp32"
    assert written["hardware"]["accelerator"] == "cpu" and written["hardware"]["world_size"] == 2
    assert written["data"] == {"folder": str(tmp_path), "realism": "real", "tokenizer": "byte-level"}
    assert written["shapes"] == {"micro_batch_size": 4, "seq_length": SPEC.seq_length, "data_parallel": 2,
                                 "global_batch_size": 8, "expert_parallel": 2, "num_microbatches": 1}
    assert written["flops_convention"] == CONVENTION and written["config"] == burst.config.to_plain()
    assert written["model"] == json.loads(SPEC.model_dump_json())
    assert Contract.model_validate(written).to_json() == written  # reads back exactly as written
    assert written["versions"]["autotune"] == code_version()


def test_the_code_version_changes_with_any_source_of_the_tuner_or_the_trainables(tmp_path: Path) -> None:
    """A table's rows come from device sessions whose code changed in between, run from a copy of the
    tree without its history: the contract's code version is a hash of the sources themselves."""
    for folder in ("autotune", "trainables"):
        (tmp_path / folder / "sub").mkdir(parents=True)
        (tmp_path / folder / "sub" / "code.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "0.1.0"\n')
    before = code_version.__wrapped__(tmp_path)
    assert re.fullmatch(r"0\.1\.0\+src\.[0-9a-f]{12}", before)
    (tmp_path / "README.md").write_text("not code")
    (tmp_path / "trainables" / "sub" / "code.cpython-311.pyc").write_bytes(b"compiled")
    assert code_version.__wrapped__(tmp_path) == before
    (tmp_path / "trainables" / "sub" / "code.py").write_text("x = 2\n")
    assert code_version.__wrapped__(tmp_path) != before


def test_counted_device_memory_counts_parameters_their_training_state_and_saved_activations() -> None:
    from trainables.native.device_memory import CountedDeviceMemory

    layer, frozen = nn.Linear(64, 32), nn.Linear(32, 8)
    frozen.requires_grad_(False)
    parameters = [*layer.parameters(), *frozen.parameters()]
    memory = CountedDeviceMemory(2**30, parameters)
    trained = sum(p.nbytes for p in layer.parameters())
    assert memory.static_bytes == 4 * trained + sum(p.nbytes for p in frozen.parameters())  # + grad, 2 moments
    x = torch.randn(16, 64)
    with memory.micro_batch() as forward_done:
        hidden = torch.relu(layer(x))  # saves x (not the weight: a parameter), and relu's output
        loss = frozen(hidden).sum()  # saves hidden again: one storage, counted once
        forward_done()
        loss.backward()
    assert memory.peak_bytes == memory.static_bytes + x.nbytes + hidden.nbytes
    with pytest.raises(torch.OutOfMemoryError, match="over the rank's"):
        CountedDeviceMemory(memory.static_bytes - 1, parameters)


def test_a_step_over_the_counted_device_memory_is_oom_the_same_at_every_length(photo_shards: Path) -> None:
    """The counted wall does not move with the process's heap: a config's peaks are the same in a
    short and a long run, and a config that holds more meets the wall at its first step."""
    roomy = replace(request(photo_shards, steps=2, world_size=2), cpu_device_memory_bytes=2**33)
    short, longer = run_local(roomy), run_local(replace(roomy, steps=4))
    assert short.outcome == longer.outcome == "ok", short.error or longer.error
    assert [r.peak_memory_bytes for r in short.records] == [r.peak_memory_bytes for r in longer.records[:2]]
    assert short.contract.hardware.counted_memory_bytes == 2**33
    budget = short.records[-1].peak_memory_bytes + 2**20
    fits = run_local(replace(roomy, cpu_device_memory_bytes=budget))
    bigger = run_local(replace(roomy, config=complete_config({**BASE, "micro_batch_size": 4}),
                               cpu_device_memory_bytes=budget))
    assert fits.outcome == "ok", fits.error
    assert bigger.outcome == "oom" and "counted device memory" in bigger.error and not bigger.records
    assert bigger.before_first_step[-1].name == "the first step, until out of memory" and not fits.before_first_step
    # Its end from the out of memory on, though no step's verdict came; the rest is the ranks' start and exit
    assert [part.name for part in bigger.teardown] == [
        "the trainable's end (its result, release)", "process group destroyed", "the ranks' start and exit"]
    # A budget under the parameters and optimizer state: out of memory in the build, after its last timed part
    static = run_local(replace(roomy, cpu_device_memory_bytes=2**10))
    assert static.outcome == "oom", static.error
    assert static.before_first_step[-1].name == "after parallel groups, to device, until out of memory"
