"""Our photo samples as a Megatron-Energon dataset in the ChatML form Megatron-Bridge's Qwen-VL data
path reads, so a ``bridge`` trial trains on real images through Bridge's own task encoder.

The form is Bridge 0.6's (``megatron.bridge.data.energon.task_encoder_utils``, and the sample
loader its own dataset scripts write): each sample is ``<key>.jpgs``, a pickled list of encoded
images that Bridge's ``videohandler`` decodes one by one, and ``<key>.json``, the conversation as
``from``/``value`` turns with one ``<image>`` per image, which ``cook_chatml_sample`` turns into
roles and the Qwen-VL task encoder into image pads. ``.nv-meta/dataset.yaml`` names Bridge's
``ChatMLWebdataset`` with that field map, and Energon's own preparation writes the index and the
train/val split (Bridge's ``prepare_webdataset`` makes the same call). Users point
``dataset.path`` at their own dataset instead.

Bridge 0.3 read ``jpgs`` as pickled pixel arrays: this targets 0.6, the release on megatron-core 0.19.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainables.data.shards import build_photo_shards, iter_samples, list_shards, write_tar

log = logging.getLogger(__name__)

DATASET_YAML = """\
__module__: megatron.bridge.data.energon.task_encoder_utils
__class__: ChatMLWebdataset
field_map:
  imgs: jpgs
  conversation: json
subflavors: {}
"""
"""The sample loader: Bridge's ChatML factory, images from ``jpgs`` and the conversation from ``json``."""
DESCRIBE_PROMPT = "<image>\nDescribe this photograph."
VALIDATION_SHARDS = 1
"""The last shard is the validation split (Bridge builds a validation loader when the recipe evaluates)."""


@dataclass(frozen=True)
class EnergonReport:
    folder: Path
    train_shards: int
    val_shards: int
    samples: int


def chatml_conversation(meta: dict) -> list[dict[str, str]]:
    """A two-exchange conversation about one photograph: describe it (the caption), then one of its
    questions; ``<image>`` once, in the first user turn."""
    conversation = [{"from": "human", "value": DESCRIBE_PROMPT}, {"from": "gpt", "value": meta["caption"]}]
    for pair in meta["qa"]:
        conversation += [{"from": "human", "value": pair["question"]}, {"from": "gpt", "value": pair["answer"]}]
    return conversation


def build_chatml_energon(out_dir: Path, samples_per_photo: int = 16, samples_per_shard: int = 64,
                         seed: int = 0, workers: int = 1) -> EnergonReport:
    """Write the photo samples of :func:`~trainables.data.shards.build_photo_shards` (same crops, same
    seed) into ``out_dir`` as ChatML shards, then prepare them with Energon: the last shard validates."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    out_dir.mkdir(parents=True, exist_ok=True)
    samples = 0
    with tempfile.TemporaryDirectory(prefix="photo-shards-") as scratch:
        build_photo_shards(Path(scratch), samples_per_photo, samples_per_shard, seed)
        shards = list_shards(Path(scratch))
        for shard in shards:
            members = []
            for key, parts in iter_samples(shard):
                meta = json.loads(parts["json"])
                members += [(f"{key}.jpgs", pickle.dumps([parts["jpg"]])),
                            (f"{key}.json", json.dumps(chatml_conversation(meta)).encode())]
                samples += 1
            write_tar(out_dir / shard.name, members)
    names = [shard.name for shard in shards]
    train, val = names[:-VALIDATION_SHARDS], names[-VALIDATION_SHARDS:]
    split_patterns = [(split, "|".join(re.escape(name) for name in part))
                      for split, part in (("train", train), ("val", val))]
    BaseWebdatasetFactory.prepare_dataset(out_dir, names, split_parts_patterns=split_patterns, shuffle_seed=None,
                                          workers=workers)
    (out_dir / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)
    log.info("%d ChatML samples in %d shards under %s", samples, len(names), out_dir)
    return EnergonReport(folder=out_dir, train_shards=len(train), val_shards=len(val), samples=samples)

