import pytest
import torch

from tests.dist.pool import close_pools, get_pool


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (never runs in CI)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dist_pool():
    """``dist_pool(world_size)``: a live gloo pool of that size, shared by the session's tests."""
    yield get_pool
    close_pools()
