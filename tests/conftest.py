"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one intra-op thread is faster, and immune to contention on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def emulated(monkeypatch):
    """Runs embcache.group's cache ops on the emulated CUDA kernels for the test's duration
    (tests/_emulated.py)."""
    import embcache.group
    from tests._emulated import Emulated

    monkeypatch.setattr(embcache.group, "_ops", Emulated(embcache.group._ops))
