"""tests/core: tiny models only; one intra-op thread keeps them fast on a small, shared CPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread():
    # Hidden-32 models gain nothing from intra-op threads, and on a loaded 2-core box OpenMP
    # spinning makes each tiny matmul take milliseconds.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
