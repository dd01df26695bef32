"""Shared fixtures: seeded RNG, a tiny config, and CLI runs in-process."""

from __future__ import annotations

import os

import pytest
import torch

# Tests must not depend on the developer's cache or threads; 2 threads match the CI machine.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_cfg():
    from mhar_ablate.config import build_config

    def make(**overrides):
        return build_config(overrides={k.replace("__", "."): v for k, v in overrides.items()})

    return make
