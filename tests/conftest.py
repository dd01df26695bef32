"""Shared test setup: offline datasets, two torch threads, a seeded RNG for every test, and a PostgreSQL
server for the tests that need one."""

from __future__ import annotations

import gc
import os

import pytest
import torch

# Tests must not depend on the developer's cache or threads; 2 threads match the CI machine.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_finish(session):
    # Every finished run calls gc.collect() (training/run.py, _release). Once the tests are collected, a full
    # collection walks about 515,000 objects that torch, Lightning and the test modules leave, 0.28 s on
    # this project's CPU machine. Frozen, they stay out of later collections; what a test creates is
    # collected as before.
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # at exit, everything is torn down as usual


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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
