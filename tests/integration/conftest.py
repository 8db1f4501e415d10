"""Fixtures the integration tests share."""

from __future__ import annotations

import pytest

from tests.kits.redis_rig import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server (Debian's) on a free loopback port, its data in the test's temp dir."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
