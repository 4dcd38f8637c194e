"""Shared builders for rule contexts and configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.contract import StackCapabilities
from autotune.knobs import Config, complete_config
from autotune.model import model_preset
from autotune.rules import RuleContext
from trainables import trainable_support

FULL_STACK = {"accelerator": "h200", "megatron_core": "0.19.2", "transformer_engine": "2.10.0", "deep_ep": True, "hybrid_ep": True}


def make_context(
    *,
    world_size: int = 8,
    model: str = "h200_small_moe_vlm",
    model_overrides: dict[str, Any] | None = None,
    trainable: str = "megatron",
    **stack: Any,
) -> RuleContext:
    """A context where only what a test names differs from a full-featured H200 megatron stack."""
    return RuleContext(
        model=model_preset(model, model_overrides),
        world_size=world_size,
        stack=StackCapabilities(**{**FULL_STACK, **stack}),
        trainable=trainable_support(trainable),
    )


def cfg(**values: Any) -> Config:
    return complete_config(values)


@pytest.fixture
def context() -> RuleContext:
    return make_context()


@pytest.fixture(scope="session")
def photo_shards(tmp_path_factory) -> Path:
    """The full built-in photo shards, built once per test session."""
    from trainables.data.shards import build_photo_shards

    folder = tmp_path_factory.mktemp("photos")
    build_photo_shards(folder)
    return folder
