"""Shared fixtures: the real tensors prepared by `make setup` (benchmarks/realdata.py)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def realdata():
    """Loads a prepared real-tensor set by name. Missing data is an error, not a skip:
    the real tensors are what the codec's claims rest on."""
    from benchmarks import realdata as rd

    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = rd.load(name)
        return cache[name]

    return load
