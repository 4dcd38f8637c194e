"""`autotune data build --energon`: our photos as the ChatML Energon dataset Megatron-Bridge 0.6 reads.

Bridge 0.6 needs Python 3.12, so here Energon itself reads the prepared dataset (its index, its
split, its sample reader: the crude factory, the loader Bridge's ``ChatMLWebdataset`` extends) and
each field is decoded the way Bridge's handlers decode it: ``jpgs`` unpickled to encoded images,
``json`` to ``from``/``value`` turns with one ``<image>`` per image. Bridge's own task encoder reads
the same directory in the GPU runs.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image
from trainables.bridge.energon import DATASET_YAML, build_chatml_energon

energon = pytest.importorskip("megatron.energon")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("energon")
    report = build_chatml_energon(folder, samples_per_photo=2, samples_per_shard=8)
    assert (report.train_shards, report.val_shards) == (report.samples // 8 - 1, 1)
    return folder


@energon.stateless
def _as_read(sample: dict) -> dict:
    return dict(sample)


class _Undecoded(energon.DefaultTaskEncoder):
    """Hands each crude sample over as read: its members' bytes, before any decoder."""

    cookers = [energon.Cooker(_as_read)]
    decoder = None


def _crude_samples(folder: Path, split: str) -> list[dict]:
    """Every sample of ``split`` through Energon's reader, undecoded, as Bridge's factory receives them."""
    (folder / ".nv-meta" / "crude.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    worker_config = energon.WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = energon.get_train_dataset(folder, split_part=split, worker_config=worker_config, batch_size=None,
                                        shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False,
                                        dataset_config="crude.yaml", task_encoder=_Undecoded())
    return list(energon.get_loader(dataset))


def test_the_sample_loader_is_bridges_chatml_factory_with_its_field_map(dataset: Path) -> None:
    loader = yaml.safe_load((dataset / ".nv-meta" / "dataset.yaml").read_text())
    assert loader == yaml.safe_load(DATASET_YAML)
    assert loader["__module__"] == "megatron.bridge.data.energon.task_encoder_utils"
    assert loader["field_map"] == {"imgs": "jpgs", "conversation": "json"}


def test_energon_reads_every_sample_in_its_split_and_each_decodes_as_bridge_decodes_it(dataset: Path) -> None:
    train, val = _crude_samples(dataset, "train"), _crude_samples(dataset, "val")
    info = json.loads((dataset / ".nv-meta" / ".info.json").read_text())
    assert len(train) + len(val) == sum(info["shard_counts"].values())
    assert len(val) == 8 and not {s["__key__"] for s in train} & {s["__key__"] for s in val}
    for sample in train + val:
        images = pickle.loads(sample["jpgs"])
        assert images and all(Image.open(io.BytesIO(encoded)).format == "JPEG" for encoded in images)
        turns = json.loads(sample["json"])
        assert [turn["from"] for turn in turns] == ["human", "gpt"] * (len(turns) // 2)
        assert sum(turn["value"].count("<image>") for turn in turns) == len(images)
        assert all(turn["value"].strip() for turn in turns)


def test_the_cli_builds_it_and_says_where_to_point_dataset_path(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "autotune", "data", "build", "--energon", str(tmp_path / "chatml"),
                             "--samples-per-photo", "1", "--samples-per-shard", "8"],
                            capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    assert f"dataset.path={tmp_path / 'chatml'}" in result.stdout
    assert (tmp_path / "chatml" / ".nv-meta" / "split.yaml").is_file()
