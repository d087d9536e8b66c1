"""The chaos suite's stack (see chaos_support.py), started once per module that uses it: a
session-wide one stayed up, six brokers idle, through every slow integration test after the
chaos modules (a CI rehearsal at load 90 with the Docker tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from chaos_support import ChaosStack, chaos_stack  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
async def chaos(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChaosStack]:
    async with chaos_stack(tmp_path_factory.mktemp("chaos")) as c:
        yield c
