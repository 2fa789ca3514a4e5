"""Shared test setup: deterministic, quiet, single-threaded torch (CI has 2 cores, tests run in 2 workers)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
