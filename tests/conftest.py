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


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (tests/pg_server.py); ``postgres.new_database()`` gives
    each test an empty database URL."""
    from pg_server import Server, find_bin

    bindir = find_bin()
    if bindir is None:
        if os.environ.get("CI") == "true":
            pytest.fail("PostgreSQL's initdb is not installed; .ci/run installs Debian's postgresql package")
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    server = Server(bindir).start()
    try:
        yield server
    finally:
        server.stop()
