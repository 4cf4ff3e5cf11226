"""Fixtures for the high-availability tests: a real Redis, and a group of real managers using it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from ha_support import Group, Redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def group(tmp_path: Path, redis_server: Redis) -> Iterator[Group]:
    """Members of replica 'r' whose group's lease is in `redis_server`; each is SIGTERMed at teardown
    (SIGCONTed first) and must exit 0, but those the test killed."""
    members = Group(tmp_path, redis_server.url)
    try:
        yield members
    finally:
        failures = members.close()
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)
