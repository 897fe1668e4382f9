import pytest
import torch

from tests.dist.pool import close_pools, get_pool


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (never runs in CI)")
    # One intra-op thread, as the pool's processes and the training runs the tests start have: the tests' tensors
    # are small, and with two threads each of their many small ops that opens an OpenMP region (MKL's fp64 sin and
    # cos, ...) waits for the second core whenever another process holds it. On a busy 2-core machine the rotary
    # gradcheck took 102 s with two threads and 5 s with one, in the same process after the same tests.
    torch.set_num_threads(1)


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
