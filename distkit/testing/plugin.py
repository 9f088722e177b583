"""pytest plugin (registered through the ``pytest11`` entry point).

It stops the shared rank pools when the session ends, and provides the ``rank_pool``
fixture for tests that want to drive a pool themselves::

    def test_something(rank_pool):
        assert rank_pool(3).run(dist.get_rank) == [0, 1, 2]
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from distkit.local.pool import RankPool, get_pool, shutdown_pools


@pytest.fixture
def rank_pool() -> Callable[..., RankPool]:
    """A function returning the session's shared pool for a world size."""
    return get_pool


def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    shutdown_pools()
