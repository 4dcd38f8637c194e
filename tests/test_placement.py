"""Topology-aware placement: a trial's GPU workers sit in one NVLink domain when they fit in one,
span domains only when they must, and concurrent trials fill a domain before breaking into
another. The end-to-end test runs a campaign on a real multi-node Ray cluster on this machine
(nodes that declare GPUs and carry domain labels), its trials replaying a recorded table through
Ray Train worker groups: the bursts do no GPU work, the placement is real."""

from __future__ import annotations

import dataclasses
from io import StringIO
from pathlib import Path

import pytest
import ray
import yaml
from ray import tune
from rich.console import Console

from autotune.campaign import load_campaign
from autotune.core.knobs import complete_config
from autotune.core.tables import RecordedBurst, append_row
from autotune.engine.driver import run_campaign
from autotune.engine.live import LiveView
from autotune.engine.placement import NODE_LABEL, NVLINK_DOMAIN_LABEL, DomainPlanner, domain_label, label_selectors
from autotune.engine.rundir import create_run_dir
from conftest import campaign_file, join_cluster, multi_node_cluster
from trainables.probe import probe


def node(domain: str | None, gpus: int = 4, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"GPU": gpus, "CPU": 8},
            "Labels": {NVLINK_DOMAIN_LABEL: domain} if domain else {}}


def test_domains_count_the_gpus_of_alive_labelled_nodes() -> None:
    planner = DomainPlanner.from_nodes([node("a"), node("a"), node("b"), node("b", alive=False), node(None),
                                        node("c", gpus=0)])
    assert planner.capacity == {"a": 8, "b": 4}


def test_a_trial_goes_to_the_fullest_domain_that_holds_it() -> None:
    planner = DomainPlanner({"a": 8, "b": 4})
    assert planner.place("t1", 4) == ["b"] * 4  # b is exactly full after; a stays whole
    assert planner.place("t2", 4) == ["a"] * 4
    assert planner.place("t3", 4) == ["a"] * 4
    assert planner.place("t4", 1) is None  # nothing free: Ray waits for slots
    planner.release("t2")
    assert planner.place("t5", 2) == ["a"] * 2


def test_a_trial_spans_domains_only_when_none_holds_it() -> None:
    planner = DomainPlanner({"a": 8, "b": 4, "c": 4})
    assert planner.place("big", 8) == ["a"] * 8
    assert planner.place("wide", 6) == ["b"] * 4 + ["c"] * 2  # fewest domains, fullest first
    assert label_selectors(planner.held["wide"], NVLINK_DOMAIN_LABEL)[0] == {NVLINK_DOMAIN_LABEL: "b"}


def test_a_lost_node_takes_its_gpus_out_of_its_domain() -> None:
    planner = DomainPlanner.from_nodes([node("a"), node("a"), node("b")])
    assert planner.place("t1", 4) == ["b"] * 4
    planner.release("t1")
    planner.observe([node("a"), node("a"), node("b", alive=False)])
    assert planner.place("t1-again", 4) == ["a"] * 4


def test_no_labels_means_no_plan() -> None:
    assert DomainPlanner.from_nodes([node(None), node(None)]).place("t", 2) is None


def test_gb200_trays_without_an_imex_channel_are_domains_of_their_own() -> None:
    """NVLink stops at the tray there: the domains planned are Ray's node ids, whatever the rack."""
    assert domain_label("gb200", imex_channel=True) == NVLINK_DOMAIN_LABEL
    assert domain_label("gb200", imex_channel=False) == NODE_LABEL
    assert domain_label("h200", imex_channel=False) == NVLINK_DOMAIN_LABEL  # a label there names a node
    trays = [node("rack-a") | {"Labels": {NVLINK_DOMAIN_LABEL: "rack-a", NODE_LABEL: f"tray{i}"}} for i in range(2)]
    planner = DomainPlanner.from_nodes(trays, NODE_LABEL)
    assert planner.capacity == {"tray0": 4, "tray1": 4}
    assert planner.place("t", 4) == ["tray0"] * 4
    assert label_selectors(planner.held["t"], planner.label)[0] == {NODE_LABEL: "tray0"}


SPACE = {
    "name": "placement_test",
    "target": {"model": "cpu_tiny_moe_vlm", "trainable": "native", "gpus_per_trial": 2, "stack": {"accelerator": "h200"}},
    "tune": {"micro_batch_size": [1, 2, 4, 8]},
    "fixed": {"moe_token_dispatcher_type": "alltoall"},
}


@pytest.fixture
def racks():
    """A head without GPUs and three one-GPU nodes (CPUs to spare, as GPU nodes have, for trial
    drivers landing there): two in rack-a, one in rack-b. One GPU a node keeps the trials' worker
    groups at two workers (each a process to start: a bare ``TorchTrainer.fit`` took 13-15 s on
    this 2-core box, 20-21 s with four), and makes every trial span nodes."""
    cluster = multi_node_cluster(num_cpus=2, num_gpus=0)
    for domain in ("rack-a", "rack-a", "rack-b"):
        cluster.add_node(num_cpus=8, num_gpus=1, labels={NVLINK_DOMAIN_LABEL: domain})
    join_cluster(cluster.address)
    try:
        yield {n["NodeID"]: n["Labels"].get(NVLINK_DOMAIN_LABEL) for n in ray.nodes()}
    finally:
        ray.shutdown()
        cluster.shutdown()


def replayed_campaign(path: Path, world_size: int, stack: dict, fixed: dict, batch_sizes: tuple[int, ...]) -> list:
    """Run the campaign at ``path`` on a recorded table of its micro-batch sizes (one GPU trial's
    workers each: no GPU work, real placement); its launched trials."""
    table = path.parent / "table.jsonl"
    for mbs in batch_sizes:
        append_row(table, RecordedBurst(
            config=complete_config({"micro_batch_size": mbs, **fixed,
                                    "freeze_vision_model": True}).to_plain(),  # campaign_file's workload freezes the ViT
            outcome="ok", step_seconds=[2.0] + [1.0 + 0.01 * (i % 3) for i in range(12)],
            useful_tokens_per_step=1000 * mbs, peak_memory_gib=1.0 * mbs, startup_seconds=5.0, error=None,
            contract={"world_size": world_size, "campaign": str(path), "stack": stack},
        ))
    campaign = dataclasses.replace(load_campaign(path), replay_table=table)
    run_dir = create_run_dir(campaign)
    with LiveView(Console(file=StringIO()), campaign.space, campaign.spec.objective) as view:
        run_campaign(campaign, run_dir, view)
    return [entry for entry in run_dir.trials.read() if entry.launched]


def test_a_local_promotion_run_pinned_to_a_node_runs_there(tmp_path: Path) -> None:
    """Unpinned, Tune spreads these trials over both nodes (seen: 2 trials, one on each); pinned to
    either node, every one runs there (a promotion run goes where the campaign's first one went)."""
    from autotune.core.registry import REPLAY
    from autotune.engine.trial import TrialJob

    cluster = multi_node_cluster(num_cpus=1)
    cluster.add_node(num_cpus=1)
    join_cluster(cluster.address)
    try:
        campaign = load_campaign(campaign_file(tmp_path, max_trials=1))
        job = TrialJob(trainable=REPLAY, request=campaign.burst_request(complete_config({}), 8), launcher="local",
                       objective=campaign.spec.objective, use_gpu=False, storage_path=str(tmp_path / "train"),
                       data_source=campaign.spec.data.source)

        def where_it_ran(config: dict) -> None:  # nested: pickled by value, as the workers cannot import tests
            tune.report({"node": ray.get_runtime_context().get_node_id()})

        def nodes(params: dict, trials: int) -> list[str]:
            tuner = tune.Tuner(tune.with_resources(where_it_ran, job.resources),
                               param_space=params, tune_config=tune.TuneConfig(num_samples=trials),
                               run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0))
            return [result.metrics["node"] for result in tuner.fit()]

        for node_id in sorted(node["NodeID"] for node in ray.nodes()):
            assert nodes({"nodes": [node_id]}, 4) == [node_id] * 4
        # a Ray Train worker group is pinned worker by worker instead
        assert label_selectors(["rack-a", "rack-a"], NVLINK_DOMAIN_LABEL, ["n1", "n2"]) == \
            [{NODE_LABEL: "n1"}, {NODE_LABEL: "n2"}]
        assert len(job.resources({"nodes": ["n1"]}).bundles) == 1
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_promotion_run_pinned_to_a_node_that_left_runs_once_more_on_the_nodes_alive(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """The race the searcher's alive check cannot close: the node goes after the run was pinned to
    it and before Ray placed it. Ray would wait for that node for ever (checked: with Tune's own
    FIFO scheduler this run never ends); the stage's scheduler ends the run ``node_lost``, charges
    it nothing, and its retry runs, unpinned, on the node still there."""
    from ray.tune.search import ConcurrencyLimiter

    from autotune.core.registry import REPLAY
    from autotune.engine import tune_roles
    from autotune.engine.ledger import Ledger
    from autotune.engine.records import Launch
    from autotune.engine.trial import TrialJob

    cluster = multi_node_cluster(num_cpus=1)
    leaving = cluster.add_node(num_cpus=1)
    join_cluster(cluster.address)
    try:
        head = ray.get_runtime_context().get_node_id()
        (gone,) = {n["NodeID"] for n in ray.nodes()} - {head}
        cluster.remove_node(leaving)
        campaign = load_campaign(campaign_file(tmp_path, max_trials=1))
        ledger = Ledger(create_run_dir(campaign, tmp_path / "runs"), world_size=1, warmup_steps=1,
                        target_relative_half_width=0.02, benchmark_only=False)
        pinned = iter([(gone,)])
        monkeypatch.setattr(tune_roles, "promotion_nodes", lambda *_: next(pinned, None))  # alive when checked
        promotion = Launch(stage="promote", space=campaign.space.name, config=complete_config({}),
                           origin="promotion")
        searcher = tune_roles.ListSearcher([promotion], ledger, steps=2)
        job = TrialJob(trainable=REPLAY, request=campaign.burst_request(complete_config({}), 2), launcher="local",
                       objective=campaign.spec.objective, use_gpu=False, storage_path=str(tmp_path / "train"),
                       data_source=campaign.spec.data.source)

        def where_it_ran(params: dict) -> None:  # nested: pickled by value, as the workers cannot import tests
            tune.report({"node": ray.get_runtime_context().get_node_id()})

        tuner = tune.Tuner(tune.with_resources(where_it_ran, job.resources),
                           tune_config=tune.TuneConfig(search_alg=ConcurrencyLimiter(searcher, max_concurrent=1),
                                                       scheduler=tune_roles.PinnedRunScheduler(ledger), num_samples=2),
                           run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0))
        results = [result.metrics.get("node") for result in tuner.fit()]
        (stranded,) = [e for e in ledger.entries if e.cause == "node_lost"]
        assert stranded.outcome == "failed" and stranded.device_seconds == 0.0 and gone in stranded.reason
        assert [e.retry_of for e in ledger.entries] == [None, stranded.trial_id]
        assert results == [None, head]  # the retry ran, on the node still there
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_promotion_run_holds_the_domains_of_its_nodes() -> None:
    planner = DomainPlanner.from_nodes([{"NodeID": "n1", **node("a")}, {"NodeID": "n2", **node("b")},
                                        {"NodeID": "n3", **node(None)}])
    assert planner.hold("p", ("n2", "n1")) == ["b", "a"] and planner.free() == {"a": 3, "b": 3}
    assert planner.hold("q", ("n3",)) is None  # no domain: Ray's label on the node is what pins it
    planner.release("p")
    assert planner.free() == {"a": 4, "b": 4}


def test_trials_workers_land_inside_one_nvlink_domain(tmp_path: Path, racks) -> None:
    """Each trial's two workers need two nodes: the two of rack-a, never one of them with rack-b's."""
    path = campaign_file(tmp_path, max_trials=1, space=SPACE, accelerator="h200", gpus_per_node=1,
                         gpus_per_trial=2, nodes=3, launcher="ray_train")
    stack = probe() | {"device_count": 1, "device_memory_bytes": 192 * 2**30}
    launched = replayed_campaign(path, 2, stack, {"moe_token_dispatcher_type": "alltoall"}, (1, 2, 4, 8))
    assert len(launched) == 2  # 1 screened, 1 promoted
    for entry in launched:
        workers = entry.contract.workers
        assert len({w.node_id for w in workers}) == 2, workers
        assert [racks[w.node_id] for w in workers] == [w.nvlink_domain for w in workers] == ["rack-a"] * 2
        assert entry.contract.environment == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}  # Hopper, TP 1, no DeepEP


HYBRID_EP_SPACE = {
    "name": "hybrid_ep_placement_test",
    "target": {"model": "cpu_tiny_moe_vlm", "trainable": "megatron", "gpus_per_trial": 4, "stack": {"accelerator": "gb200"}},
    "tune": {"micro_batch_size": [1, 2]},
    "fixed": {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
              "expert_model_parallel_size": 4},
}


def gb200_hybrid_ep_trials(tmp_path: Path, trays: tuple[str, str], expert_parallel: int, gpus_per_tray: int,
                           imex_channels: int) -> list:
    """A HybridEP campaign of EP ``expert_parallel`` (one GPU per rank) replayed on two GB200 trays
    of ``gpus_per_tray`` GPUs (small, for the test: each rank is a Ray Train worker to start)
    labelled with ``trays``' domains, whose recorded probe holds ``imex_channels``; its launched
    trials, each checked to have run."""
    space = HYBRID_EP_SPACE | {"target": HYBRID_EP_SPACE["target"] | {"gpus_per_trial": expert_parallel},
                               "fixed": HYBRID_EP_SPACE["fixed"] | {"expert_model_parallel_size": expert_parallel}}
    cluster = multi_node_cluster(num_cpus=2, num_gpus=0)
    for domain in trays:
        cluster.add_node(num_cpus=4, num_gpus=gpus_per_tray, labels={NVLINK_DOMAIN_LABEL: domain})
    join_cluster(cluster.address)
    try:
        path = campaign_file(tmp_path, max_trials=1, space=space, accelerator="gb200", gpus_per_node=gpus_per_tray,
                             gpus_per_trial=expert_parallel, nodes=2, launcher="ray_train")
        campaign = yaml.safe_load(path.read_text())
        campaign["trainable"] = "megatron"
        path.write_text(yaml.safe_dump(campaign))
        stack = probe() | {"accelerator": "gb200", "device_count": gpus_per_tray, "device_memory_bytes": 192 * 2**30,
                           "megatron_core": "0.19.2", "transformer_engine": "2.20.2", "hybrid_ep": True,
                           "imex_channels": imex_channels}
        launched = replayed_campaign(path, expert_parallel, stack, space["fixed"], (1, 2))
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert launched and all(entry.outcome in ("ok", "pruned") for entry in launched), [(e.outcome, e.reason)
                                                                                       for e in launched]
    return launched


@pytest.mark.parametrize("trays, ranks_per_domain", [(("rack-a", "rack-a"), "2"), (("rack-a", "rack-b"), "1")],
                         ids=["one-rack", "two-racks"])
def test_a_hybrid_ep_trial_is_told_how_many_of_its_ranks_share_an_nvlink_domain(
        tmp_path: Path, trays: tuple[str, str], ranks_per_domain: str) -> None:
    """Two GB200 trays (of one GPU here, to keep the test small); each trial's EP group of 2 takes
    both. In one rack its 2 ranks share one NVLink domain across the trays (MNNVL); over two racks
    each holds 1 of them."""
    for entry in gb200_hybrid_ep_trials(tmp_path, trays, expert_parallel=2, gpus_per_tray=1, imex_channels=1):
        assert [w.nvlink_domain for w in entry.contract.workers] == list(trays)
        assert entry.contract.environment == {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "USE_MNNVL": "1",
                                              "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": ranks_per_domain}


def test_without_an_imex_channel_a_hybrid_ep_trial_stays_on_one_tray(tmp_path: Path) -> None:
    """Two GB200 trays of one rack whose processes hold no IMEX channel: each trial's EP group of 2
    runs on one tray (planned by node id), told its tray is its domain, without MNNVL."""
    for entry in gb200_hybrid_ep_trials(tmp_path, ("rack-a", "rack-a"), expert_parallel=2, gpus_per_tray=2,
                                        imex_channels=0):
        assert len({w.node_id for w in entry.contract.workers}) == 1, entry.contract.workers
        assert entry.contract.environment == {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "USE_MNNVL": "0",
                                              "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "2"}
