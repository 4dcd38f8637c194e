"""The megatron-core trainable on the CPU: its model builds (on the meta device) at the presets'
published sizes, it refuses to train without CUDA, and the capability probe feeds the rules.
Training itself needs CUDA: the ``gpu`` test runs only where there is one."""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core", reason="needs the `megatron` extra (megatron-core)")

import torch  # noqa: E402

from autotune.bursts import run_burst  # noqa: E402
from autotune.campaign import load_campaign  # noqa: E402
from autotune.core.contract import BurstRequest, DataSpec  # noqa: E402
from autotune.core.errors import AutotuneError  # noqa: E402
from autotune.core.knobs import complete_config  # noqa: E402
from autotune.core.model import model_preset  # noqa: E402
from autotune.engine.probe import apply_probe  # noqa: E402
from trainables.probe import accelerator_label, probe  # noqa: E402

pytestmark = pytest.mark.megatron
warnings.filterwarnings("ignore", module="megatron")


@pytest.fixture(scope="module")
def model_parallel():
    """A one-rank gloo group with megatron-core's parallel state, as a burst sets it up."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


KEPT_GROUPS_SCENARIO = """
import json, tempfile
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from autotune.core.knobs import complete_config
from trainables import launch
from trainables.megatron.burst import _release, parallel_groups
from trainables.steps import BuildClock

def groups():
    return set(dist.distributed_c10d._world.pg_map)

config, seen = complete_config({}), {}
launch._join_process_group("gloo", tempfile.mkdtemp(), 0, 1)
seen["first"] = parallel_groups(config)
made = groups()
# What a burst's layers left in megatron-core's global memory buffer (on the GPU, device memory
# that a kept rank's check counts) goes with the burst's release; the groups stay.
parallel_state.get_global_memory_buffer().buffer[("mpu", torch.bfloat16)] = torch.empty(1 << 20, dtype=torch.bfloat16)
_release(None, BuildClock(torch.device("cpu"), synchronize=False))
seen["buffer_emptied"] = parallel_state.get_global_memory_buffer().buffer == {}
seen["end"] = launch._end_process_groups(keep_world=True)
seen["groups_kept"] = groups() == made
launch._join_process_group("gloo", tempfile.mkdtemp(), 0, 1)  # a kept rank's next burst: the same world
seen["second"] = parallel_groups(config)
seen["the_same_groups"] = groups() == made
launch._end_process_groups(keep_world=False)  # a world that ends (a burst of ranks left unbalanced): the groups go with it
launch._join_process_group("gloo", tempfile.mkdtemp(), 0, 1)
seen["after_a_new_world"] = parallel_groups(config)
seen["new_groups"] = len(groups()) == len(made) and not groups() & made
print(json.dumps(seen))
"""


def test_a_kept_rank_of_one_keeps_megatrons_parallel_groups_for_its_next_burst() -> None:
    """Destroying megatron-core's twenty one-rank groups took 0.57-0.80 s of a kept trial's end on an
    H100: in a world of one (a single layout) the next burst takes them as they are, without what the
    last burst's layers cached beside them. Once the world itself ends, they went with it, and the
    next burst makes its own in the new one."""
    import json
    import subprocess
    import sys

    ran = subprocess.run([sys.executable, "-c", KEPT_GROUPS_SCENARIO], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen == {"first": "parallel groups", "buffer_emptied": True,
                    "end": "the burst's own process groups destroyed, the world's kept",
                    "groups_kept": True, "second": "parallel groups, kept from the last burst", "the_same_groups": True,
                    "after_a_new_world": "parallel groups", "new_groups": True}


KEPT_GROUPS_OF_TWO_SCENARIO = """
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from autotune.core.knobs import complete_config
from trainables import launch
from trainables.megatron.burst import parallel_groups

folder, rank = Path(sys.argv[1]), int(sys.argv[2])
def next_burst(n):
    (folder / str(n)).mkdir(exist_ok=True)
    launch._join_process_group("gloo", str(folder / str(n)), rank, 2)
def groups():
    return set(dist.distributed_c10d._world.pg_map) - {dist.GroupMember.WORLD}

expert_parallel, data_parallel, seen = complete_config({"expert_model_parallel_size": 2}), complete_config({}), {}
next_burst(0)
seen["first"] = parallel_groups(expert_parallel)
made = groups()
seen["end"] = launch._end_process_groups(keep_world=True)
next_burst(1)
seen["second"] = parallel_groups(expert_parallel)
seen["the_same_groups"] = groups() == made
total = torch.ones(1)
dist.all_reduce(total, group=parallel_state.get_expert_model_parallel_group())
seen["expert_parallel_sum"] = total.item()
launch._end_process_groups(keep_world=True)
next_burst(2)
seen["another_layout"] = parallel_groups(data_parallel)
seen["expert_parallel_size"] = parallel_state.get_expert_model_parallel_world_size()
seen["none_of_the_last_layouts"] = not groups() & made
print(json.dumps(seen))
"""


def test_kept_ranks_of_two_keep_megatrons_groups_for_a_burst_of_the_same_layout_only(tmp_path: Path) -> None:
    """In a kept world of two ranks, a burst of the last burst's parallel layout takes its groups as
    they are (and they work: an expert-parallel all-reduce over them); a burst of another layout
    destroys them and makes its own."""
    import json
    import subprocess
    import sys

    ranks = [subprocess.Popen([sys.executable, "-c", KEPT_GROUPS_OF_TWO_SCENARIO, str(tmp_path), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for rank in ranks:
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {
            "first": "parallel groups", "end": "the burst's own process groups destroyed, the world's kept",
            "second": "parallel groups, kept from the last burst", "the_same_groups": True,
            "expert_parallel_sum": 2.0, "another_layout": "parallel groups", "expert_parallel_size": 1,
            "none_of_the_last_layouts": True}


def build_on_meta(preset: str, overrides: dict | None = None, **knobs):
    from trainables.megatron.config_mapping import build_transformer_config
    from trainables.megatron.model import PORTABLE_FIELDS, MegatronMoEVLM

    spec = model_preset(preset, overrides)
    config = build_transformer_config(complete_config(knobs), spec,
                                      extra=PORTABLE_FIELDS | {"use_cpu_initialization": True})
    with torch.device("meta"):
        return spec, MegatronMoEVLM(config, spec, use_te=False)


# Published sizes: Qwen3-VL-30B-A3B and -235B-A22B (total parameters; active per token).
SIZES = {
    "h200_small_moe_vlm": ((0.9e9, 1.1e9), (0.25e9, 0.35e9)),
    "qwen3_vl_30b_a3b_like": ((29e9, 33e9), (3e9, 4.2e9)),
    "qwen3_vl_235b_a22b_like": ((228e9, 240e9), (21e9, 24e9)),
}


@pytest.mark.parametrize("preset", SIZES)
def test_presets_build_at_their_published_sizes(model_parallel, preset: str) -> None:
    spec, model = build_on_meta(preset)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = total - experts + experts * spec.moe_router_topk // spec.num_moe_experts
    (total_low, total_high), (active_low, active_high) = SIZES[preset]
    assert total_low <= total <= total_high
    assert active_low <= active <= active_high
    # Every MoE layer holds all experts on one rank (EP = 1) and the vision stack is there.
    assert experts > 0 and model.pre_process and sum(p.numel() for p in model.vision_model.parameters()) > 0


def test_moe_layers_are_built_for_partial_graphs(model_parallel) -> None:
    """MoE layers are megatron-core's ``MoETransformerLayer`` (whose local graphs capture the router
    and leave the dropless dispatch eager); dense layers stay ``TransformerLayer``."""
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    _, model = build_on_meta("h200_small_moe_vlm", {"first_k_dense_layers": 2})
    layers = list(model.language_model.decoder.layers)
    assert [isinstance(layer, MoETransformerLayer) for layer in layers] == [False, False] + [True] * (len(layers) - 2)


def test_freeze_keeps_llava_meaning(model_parallel) -> None:
    _, model = build_on_meta("h200_small_moe_vlm")
    model.freeze(freeze_vision_model=True, freeze_vision_projection=False, freeze_language_model=False)
    assert not any(p.requires_grad for p in model.vision_model.parameters())
    assert all(p.requires_grad for p in model.vision_projection.parameters())
    assert all(p.requires_grad for p in model.language_model.parameters())


def test_packed_mask_is_causal_within_samples() -> None:
    from trainables.megatron.model import packed_causal_mask

    mask = packed_causal_mask(torch.tensor([[1, 1, 2, 2, 0]]))[0, 0]
    allowed = ~mask
    assert allowed[1, 0] and not allowed[0, 1]  # causal inside sample 1
    assert not allowed[2, 1] and allowed[3, 2]  # sample 2 never sees sample 1


class _Dispatcher:
    """As megatron-core's all-to-all token dispatcher: keeps the last router probabilities."""

    def route(self, probs: torch.Tensor) -> torch.Tensor:
        self.probs = probs
        return probs


class _MoELayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.token_dispatcher = _Dispatcher()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.token_dispatcher.route(self.router(hidden).softmax(-1))


class _GraphRunner(torch.nn.Module):
    """As megatron-core's local CUDA-graph runner: keeps the forward it recorded, outputs in a tuple."""

    def __init__(self, base_module: torch.nn.Module) -> None:
        super().__init__()
        self.base_module = base_module
        self.outputs: tuple[torch.Tensor, ...] | None = None

    def record(self, output: torch.Tensor) -> torch.Tensor:
        self.outputs = (output,)
        return output


class _GraphManager(torch.nn.Module):
    """As megatron-core's ``CudaGraphManager``: its runners in a plain list, not submodules."""

    def __init__(self, base_module: torch.nn.Module) -> None:
        super().__init__()
        self.cudagraph_runners = [_GraphRunner(base_module)]


class _GraphedLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.cudagraph_manager = _GraphManager(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cudagraph_manager.cudagraph_runners[0].record(self.linear(hidden))


class _HookedWrapper(torch.nn.Module):
    """As megatron-core's DDP: a hook on each parameter's gradient accumulator closes over it."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.gradients_ready = 0
        self.grad_accs = []
        for param in module.parameters():
            grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._count_ready_gradient)
            self.grad_accs.append(grad_acc)

    def _count_ready_gradient(self, *_gradients) -> None:
        self.gradients_ready += 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module(hidden)


@pytest.mark.parametrize("layer", [_MoELayer, _GraphedLayer], ids=["dispatcher", "local-graph-runner"])
@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
def test_a_trained_model_is_collected_once_its_kept_graphs_are_dropped(drop: bool, layer: type) -> None:
    """A tensor that keeps a trained step's autograd graph on a module's helper (the dispatcher's
    probabilities; a local-graph runner's recorded outputs, the runner in a list) ties the model to
    C++ nodes whose hooks close over the wrapper: the collector cannot free it until the tensor goes."""
    from trainables.megatron.burst import drop_kept_autograd_graphs

    wrapper = _HookedWrapper(layer())
    wrapper(torch.randn(3, 8)).sum().backward()
    assert wrapper.gradients_ready == 2  # the layer's weight and bias
    alive = weakref.ref(wrapper)
    if drop:
        drop_kept_autograd_graphs(wrapper)
        if layer is _MoELayer:
            assert wrapper.module.token_dispatcher.probs is None
        else:
            assert wrapper.module.cudagraph_manager.cudagraph_runners[0].outputs is None
            assert wrapper.module.linear.weight is not None  # parameters carry no graph: kept
    del wrapper
    gc.collect()
    assert (alive() is None) is drop


def test_burst_without_cuda_is_invalid_with_the_reason(photo_shards: Path) -> None:
    request = BurstRequest(config=complete_config({}), model=model_preset("cpu_tiny_moe_vlm"),
                           data=DataSpec(str(photo_shards)), steps=2, world_size=1)
    result = run_burst("megatron", request)
    assert result.outcome == "invalid"
    assert "CUDA" in result.error


def test_the_end_of_a_step_evidence_and_contract_on_one_rank(model_parallel, photo_shards: Path) -> None:
    """What follows megatron-core's forward-backward, on one CPU rank (the GPU test runs it for
    real): the only rank counts the batches and reports the loss, and the evidence and contract
    carry the keys a megatron burst writes."""
    from trainables.data.loader import rank_loader
    from trainables.megatron.burst import MegatronRun, _local_measures
    from trainables.megatron.model import decoder_kernel_fields
    from trainables.steps import count_batches, finish_step

    spec, vlm = build_on_meta("cpu_tiny_moe_vlm")
    request = BurstRequest(config=complete_config({}), model=spec, data=DataSpec(str(photo_shards)), steps=1,
                           world_size=1, data_workers=0)
    run = MegatronRun(request=request, device=torch.device("cpu"), rank=0, world_size=1, model=vlm, vlm=vlm,
                      optimizer=None, clock=None, batches=iter(()), num_microbatches=2, layer_spec="local",
                      kernels=decoder_kernel_fields(False))
    batches = [batch for batch, _ in zip(rank_loader(request, 0, 1), range(2))]
    losses = [{"loss": torch.tensor(2.0)}, {"loss": torch.tensor(3.0)}]
    local = _local_measures(run, batches, losses, {"vision": 0.25, "projector": 0.125}, 1.0, 0.5)
    assert local.counts == count_batches(batches, request) and local.loss == 2.5
    reports = []
    record, stop = finish_step(run, 0, local, lambda report: reports.append(report) or True)
    assert not stop and record.decoder_seconds == 0.125 and record.loss == 2.5
    assert record.useful_tokens == sum(batch.useful_tokens for batch in batches) > 0
    evidence, contract = reports[0].evidence, reports[0].contract.to_json()
    assert set(evidence.checks) == {"recompute_granularity", "freeze_vision_model", "expert_model_parallel_size",
                                    "tensor_model_parallel_size", "use_torch_fsdp2", "use_megatron_fsdp",
                                    "cuda_graph_impl", "moe_grouped_gemm"}
    assert all(evidence.checks.values()), evidence.checks
    assert evidence.layer_spec == "local" and evidence.tp_group_size == 1 and evidence.cuda_graph_units == 0
    assert contract["trainable"] == "megatron" and contract["layer_spec"] == "local"
    assert contract["kernels"] == decoder_kernel_fields(False) and not any(contract["kernels"].values())
    assert set(contract["versions"]) == {"python", "torch", "autotune", "cuda", "megatron_core", "transformer_engine"}
    assert set(contract["hardware"]) == {"device", "accelerator", "world_size"}
    assert contract["shapes"]["num_microbatches"] == 2 and contract["shapes"]["global_batch_size"] == 2
    assert set(contract["shapes"]) == {"micro_batch_size", "seq_length", "num_microbatches", "data_parallel",
                                       "global_batch_size", "tensor_parallel", "pipeline_parallel",
                                       "context_parallel", "expert_parallel", "expert_tensor_parallel"}


@pytest.mark.parametrize(("micro_batch_size", "data_parallel", "expected"), [(1, 1, 8), (2, 2, 2), (4, 2, 1)])
def test_megatron_counts_the_workloads_micro_batches_per_step(micro_batch_size: int, data_parallel: int,
                                                              expected: int) -> None:
    """megatron-core's own calculator, set from the workload's global batch, gives GBS / (MBS × DP)."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from trainables.megatron.config_mapping import init_micro_batch_calculator

    request = BurstRequest(config=complete_config({"micro_batch_size": micro_batch_size}),
                           model=model_preset("cpu_tiny_moe_vlm"), data=DataSpec("."), steps=1,
                           world_size=data_parallel, global_batch_size=8)
    try:
        assert init_micro_batch_calculator(request, data_parallel, rank=0) == expected
    finally:
        destroy_num_microbatches_calculator()


def test_megatron_refuses_a_global_batch_its_micro_batches_do_not_divide() -> None:
    from autotune.core.contract import InvalidConfig
    from trainables.megatron.config_mapping import init_micro_batch_calculator

    request = BurstRequest(config=complete_config({"micro_batch_size": 4}), model=model_preset("cpu_tiny_moe_vlm"),
                           data=DataSpec("."), steps=1, world_size=2, global_batch_size=12)
    with pytest.raises(InvalidConfig, match=r"micro_batch_size 4 × data-parallel 2 = 8 samples"):
        init_micro_batch_calculator(request, 2, rank=0)


class _GraphHelper:
    """What ``TransformerEngineGraphs`` calls on megatron-core's ``TECudaGraphHelper``; each
    "graph" is a function, as TE's graphed callables are."""

    def __init__(self, layers: int) -> None:
        self.flattened_callables = [SimpleNamespace(cuda_graphs=[]) for _ in range(layers)]
        self.created = False

    def capture_finished(self) -> bool:
        return self.created

    def graphs_created(self) -> bool:
        return self.created and any(layer.cuda_graphs for layer in self.flattened_callables)

    def create_cudagraphs(self) -> None:
        self.created = True
        for layer in self.flattened_callables:
            layer.cuda_graphs.append(lambda hidden: hidden)

    def delete_cuda_graphs(self) -> None:
        for layer in self.flattened_callables:
            layer.cuda_graphs.clear()


class _PreprocessingDispatcher:
    def dispatch_preprocess(self, hidden, probs):
        return hidden, probs


def _layer(moe: bool) -> torch.nn.Module:
    """A decoder layer's parts as megatron-core names them, each a module that can run."""
    layer = torch.nn.Module()
    layer.is_moe_layer = moe
    layer.self_attention = torch.nn.Identity()
    layer.mlp = torch.nn.Identity()
    if moe:
        layer.mlp.router = torch.nn.Identity()
        layer.mlp.token_dispatcher = _PreprocessingDispatcher()
    return layer


def _eager_step(layers, graphed: set[str]) -> None:
    """What Python runs of each layer in a step after the capture: every part outside the graphs."""
    x = torch.zeros(1)
    for layer in layers:
        if "attn" not in graphed:
            layer.self_attention(x)
        if not layer.is_moe_layer:
            if "mlp" not in graphed:
                layer.mlp(x)
            continue
        if "moe" in graphed:
            continue
        layer.mlp(x)
        if "moe_router" not in graphed:
            layer.mlp.router(x)
        if "moe_preprocess" not in graphed:
            layer.mlp.token_dispatcher.dispatch_preprocess(x, x)


@pytest.mark.parametrize(("graphed", "config_scope", "matches"), [
    ({"attn", "moe_router", "moe_preprocess"}, ["attn", "moe_router", "moe_preprocess"], True),
    ({"attn"}, ["attn"], True),
    ({"attn"}, ["attn", "moe_router", "moe_preprocess"], False),  # the MoE parts ran eagerly
    ({"attn", "moe_router"}, ["attn", "moe_router", "moe_preprocess"], False),
    ({"attn", "moe_router", "moe_preprocess"}, ["attn"], False),  # more graphed than asked
    ({"attn", "mlp", "moe"}, [], True),  # an empty scope graphs the whole layer
    ({"attn", "moe"}, [], False),  # the dense layer's MLP ran eagerly
    ({"attn", "mlp", "moe"}, ["attn", "mlp", "moe"], True),
    (set(), ["attn"], False),
])
def test_the_graphed_scope_is_what_python_no_longer_runs(graphed: set[str], config_scope: list[str],
                                                        matches: bool) -> None:
    """A scope name counts as graphed when its part ran in no layer after the capture, and the check
    holds only when that is exactly the config's scope (empty: the whole layer, here a dense layer
    and a MoE layer, whose router and preprocessing then sit inside ``moe``)."""
    from trainables.megatron.graph_scope import GraphScopeWatch

    layers = [_layer(moe=False), _layer(moe=True)]
    watch = GraphScopeWatch.of(layers)
    _eager_step(layers, graphed)
    assert (watch.graphed() == watch.expected(config_scope)) is matches
    watch.close()
    assert all(not m._forward_pre_hooks for layer in layers for m in layer.modules())
    assert "dispatch_preprocess" not in vars(layers[1].mlp.token_dispatcher)


def test_the_scope_watch_fits_megatron_cores_layers(model_parallel) -> None:
    """The parts the watch hooks exist under these names in the installed megatron-core's layers,
    and closing it leaves them as built."""
    from trainables.megatron.graph_scope import GraphScopeWatch

    _, vlm = build_on_meta("cpu_tiny_moe_vlm")
    layers = list(vlm.language_model.decoder.layers)
    watch = GraphScopeWatch.of(layers)
    moe_layers = sum(layer.is_moe_layer for layer in layers)
    assert moe_layers and len(watch.calls["attn"]) == len(layers)
    assert len(watch.calls["moe_router"]) == len(watch.calls["moe_preprocess"]) == moe_layers
    assert watch.graphed() == watch.expected([])  # nothing ran since: every part looks graphed
    watch.close()
    assert all(not m._forward_pre_hooks for layer in layers for m in layer.modules())
    assert all("dispatch_preprocess" not in vars(layer.mlp.token_dispatcher) for layer in layers if layer.is_moe_layer)


def test_graph_knob_checks_fail_when_no_graph_ran(model_parallel, photo_shards: Path) -> None:
    """A graph knob whose graphs were never captured, or captured and never replayed, fails its
    check; so does a graph that ran with the knob off. The TE graphs count their replays."""
    from trainables.megatron.burst import MegatronRun, TransformerEngineGraphs
    from trainables.megatron.model import decoder_kernel_fields

    spec, vlm = build_on_meta("cpu_tiny_moe_vlm")

    def checks(te_graphs, **knobs) -> dict[str, bool]:
        request = BurstRequest(config=complete_config(knobs), model=spec, data=DataSpec(str(photo_shards)), steps=1,
                               world_size=1, data_workers=0)
        run = MegatronRun(request=request, device=torch.device("cpu"), rank=0, world_size=1, model=vlm, vlm=vlm,
                          optimizer=None, clock=None, batches=iter(()), num_microbatches=1, layer_spec="local",
                          kernels=decoder_kernel_fields(False), te_graphs=te_graphs)
        return run.evidence().checks

    te = {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]}
    assert checks(None, **te)["cuda_graph_impl"] is False
    decoder_layers = [_layer(moe=True)]
    graphs = TransformerEngineGraphs(_GraphHelper(layers=3), capture_step=2, overlap_param_gather=False,
                                     decoder_layers=decoder_layers)
    graphs.before_step(1)
    assert checks(graphs, **te)["cuda_graph_impl"] is False  # not captured yet
    assert checks(graphs, **te)["cuda_graph_scope"] is False
    graphs.before_step(2)
    assert checks(graphs, **te)["cuda_graph_impl"] is False  # captured, never replayed
    assert checks(graphs, **te)["cuda_graph_scope"] is False
    assert graphs.helper.flattened_callables[0].cuda_graphs[0](5) == 5
    _eager_step(decoder_layers, graphed={"attn"})
    assert checks(graphs, **te)["cuda_graph_impl"] is True
    assert checks(graphs, **te)["cuda_graph_scope"] is True
    assert checks(graphs, cuda_graph_impl="transformer_engine",
                  cuda_graph_scope=["attn", "moe_router", "moe_preprocess"])["cuda_graph_scope"] is False
    assert checks(graphs)["cuda_graph_impl"] is False  # graphs ran with the knob off
    observed = graphs.observed()
    assert observed["te_graphs_captured"] == 3 and observed["te_graph_replays"] == 1
    assert observed["te_graphed_scope"] == ["attn"]
    graphs.delete()
    assert not decoder_layers[0].self_attention._forward_pre_hooks
    assert checks(None, moe_grouped_gemm=True)["moe_grouped_gemm"] is False  # SequentialMLP built
    assert checks(None, freeze_vision_model=True)["freeze_vision_model"] is False  # vision still trains


def test_a_te_that_cannot_load_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """An installed TE whose core library cannot load counts as absent, with one line saying why."""
    from trainables import probe as probe_module

    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(
        "raise OSError('libtransformer_engine.so: cannot open shared object file: No such file or directory')")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe_module.transformer_engine_status.cache_clear()
    try:
        version, problem = probe_module.transformer_engine_status()
        facts = probe_module.probe()
    finally:
        probe_module.transformer_engine_status.cache_clear()
    assert version is None and "\n" not in problem
    assert problem.endswith("cannot load: OSError: libtransformer_engine.so: cannot open shared object file: "
                            "No such file or directory")
    assert facts["transformer_engine"] is None and facts["transformer_engine_error"] == problem
    campaign = load_campaign(Path("campaigns/h200_te.yaml"))
    probed, changes = apply_probe(campaign, [_node(transformer_engine_error=problem)])
    assert probed.stack.transformer_engine is None and problem in changes


def test_probe_reports_this_machine() -> None:
    facts = probe()
    assert facts["torch"] == torch.__version__
    from megatron.core import __version__ as installed

    assert facts["megatron_core"] == installed
    assert facts["accelerator"] == ("cpu" if not torch.cuda.is_available() else accelerator_label(facts["device_name"]))
    # Which machine: every lent one is called "vm", so the host's CPU and the device's own id say it.
    cpu_model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    assert facts["host_cpu"] == f"{cpu_model}, {len(os.sched_getaffinity(0))} cores"
    assert (facts["device_uuid"] is None) == (not torch.cuda.is_available())
    assert accelerator_label("NVIDIA H200") == "h200" and accelerator_label("NVIDIA GB200") == "gb200"


def _node(**overrides) -> dict:
    return {"megatron_core": "0.19.2", "transformer_engine": None, "deep_ep": False, "hybrid_ep": False,
            "device_count": 1} | overrides


def test_probe_replaces_the_campaign_stack_and_says_so() -> None:
    campaign = load_campaign(Path("campaigns/h200_single.yaml"))
    probed, changes = apply_probe(campaign, [_node(megatron_core="0.16.1")])
    assert probed.stack.megatron_core == "0.16.1" and probed.rule_context.stack.megatron_core == "0.16.1"
    assert any("megatron_core" in change for change in changes)
    # A package only some nodes have counts as absent.
    mixed, _ = apply_probe(campaign, [_node(transformer_engine="2.10"), _node()])
    assert mixed.stack.transformer_engine is None


def test_probe_reads_the_imex_channels_the_processes_hold(tmp_path: Path, monkeypatch) -> None:
    """On GB200 a pod's IMEX channel (its ComputeDomain claim) is what lets HybridEP span trays:
    the probe counts them, and the stack has one only where every node does."""
    from trainables import probe as probe_module

    monkeypatch.setattr(probe_module, "IMEX_CHANNELS", tmp_path / "nvidia-caps-imex-channels")
    assert probe_module.probe()["imex_channels"] == 0  # no such folder
    (tmp_path / "nvidia-caps-imex-channels").mkdir()
    (tmp_path / "nvidia-caps-imex-channels" / "channel0").touch()
    assert probe_module.probe()["imex_channels"] == 1
    campaign = load_campaign(Path("campaigns/gb200_3d.yaml"))
    with_channels, _ = apply_probe(campaign, [_node(imex_channels=1), _node(imex_channels=1)])
    assert with_channels.stack.imex_channel and with_channels.rule_context.stack.imex_channel
    one_lacks, _ = apply_probe(campaign, [_node(imex_channels=1), _node(imex_channels=0)])
    assert not one_lacks.stack.imex_channel


def test_burst_judges_the_config_by_this_machine(monkeypatch) -> None:
    """``autotune burst`` asks this machine's probe, not the campaign's assumed stack: with TE
    installed here, grouped GEMM passes a campaign that assumed no TE."""
    from autotune.cli import burst_cmd
    from autotune.rules import violations

    campaign = load_campaign(Path("campaigns/h200_single.yaml"))
    grouped = complete_config({"moe_grouped_gemm": True})
    assert "grouped_gemm_needs_te" in {v.rule for v in violations(grouped, campaign.rule_context)}
    monkeypatch.setattr(burst_cmd, "probe_this_machine", lambda: _node(transformer_engine="2.20.2"))
    judged = burst_cmd._judged_by_this_machine(campaign.rule_context)
    assert judged.stack.transformer_engine == "2.20.2"
    assert "grouped_gemm_needs_te" not in {v.rule for v in violations(grouped, judged)}


def test_probe_rejects_a_cluster_that_cannot_run_the_campaign() -> None:
    campaign = load_campaign(Path("campaigns/h200_single.yaml"))
    with pytest.raises(AutotuneError, match="different megatron-core"):
        apply_probe(campaign, [_node(), _node(megatron_core="0.16.1")])
    with pytest.raises(AutotuneError, match="no node has a CUDA device"):
        apply_probe(campaign, [_node(device_count=0)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="training needs CUDA")
def test_gpu_burst_trains_with_its_knobs_in_effect(photo_shards: Path) -> None:
    config = complete_config({"micro_batch_size": 2, "recompute_granularity": "selective",
                              "recompute_modules": ["moe"], "freeze_vision_model": True})
    request = BurstRequest(config=config, model=model_preset("h200_small_moe_vlm"),
                           data=DataSpec(str(photo_shards)), steps=4, world_size=1, data_workers=2)
    result = run_burst("megatron", request)
    assert result.outcome == "ok", result.error
    assert result.evidence.checks and all(result.evidence.checks.values()), result.evidence
    assert result.records[-1].image_tokens > 0 and result.records[-1].vision_seconds > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="training needs CUDA")
def test_gpu_a_kept_rank_runs_bring_up_after_a_te_graph_burst_as_a_new_process_does(tmp_path: Path) -> None:
    """The issue's proof for megatron's kept ranks, on the GPU: bring-up, the TE warm start (TE
    graphs) and bring-up again in one kept rank. Each burst after the first runs kept, so each left
    its device memory back; bring-up's losses after the TE burst are those of bring-up in a new
    process up to what kernels that accumulate with atomics change (0.0012 at most on an H100,
    bench/results/h100_kept_ranks_te_20261206/; 0.01 allowed)."""
    pytest.importorskip("transformer_engine.pytorch")
    from autotune.core.registry import start_rank_zygote
    from trainables import launch
    from trainables.launch import run_local

    campaign = load_campaign(Path("campaigns/h100_te.yaml"))
    bring_up, te_graphs = (campaign.burst_request(start.config, 6) for start in campaign.space.warm_starts[:2])
    assert te_graphs.config.cuda_graph_impl == "transformer_engine"
    addresses = [str(tmp_path / "kept.sock"), str(tmp_path / "new.sock")]
    zygotes = [start_rank_zygote(address, "megatron") for address in addresses]
    try:
        builds: list[list[str]] = []

        def reporter(report) -> bool:
            if report.build_phases:
                builds.append([part.name for part in report.build_phases])
            return True

        results = [run_local(request, reporter=reporter, trainable="megatron", warm_ranks=addresses[0])
                   for request in (bring_up, te_graphs, bring_up)]
        from_new = run_local(bring_up, reporter=lambda report: True, trainable="megatron", warm_ranks=addresses[1])
    finally:
        for process in zygotes:
            process.kill()
            process.wait()
    for result in (*results, from_new):
        assert result.outcome == "ok", result.error
    assert [result.contract.rank_start for result in (*results, from_new)] == ["warm", "kept", "kept", "warm"]
    assert results[1].evidence.checks["cuda_graph_impl"], results[1].evidence
    assert results[2].teardown[-2].name == launch.WORLD_KEPT
    # megatron-core's groups made once, then kept with the world
    assert [next(part for part in build if part.startswith("parallel groups")) for build in builds] == [
        "parallel groups", "parallel groups, kept from the last burst", "parallel groups, kept from the last burst"]
    # The trainable's end, split where it timed its release
    assert [part.name for part in results[2].release] == [
        "data loader's workers ended", "graphs dropped", "megatron-core and TE state reset", "objects collected",
        "allocator cache emptied"]
    assert results[2].teardown[0].name == "release: data loader's workers ended"
    assert len(results[2].records) == len(from_new.records)
    assert max(abs(kept.loss - new.loss) for kept, new in zip(results[2].records, from_new.records)) <= 0.01
