"""Fixtures for gateway tests: in-process mock workers on a background loop."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.mock_workers import MockHost


@pytest.fixture
def mocks() -> Iterator[MockHost]:
    host = MockHost()
    try:
        yield host
    finally:
        host.close()
