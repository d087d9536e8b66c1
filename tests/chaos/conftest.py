"""The chaos suite's stack, started once for the whole session (see chaos_support.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from chaos_support import ChaosStack, chaos_stack  # type: ignore[import-not-found]


@pytest.fixture(scope="session")
async def chaos(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChaosStack]:
    async with chaos_stack(tmp_path_factory.mktemp("chaos")) as c:
        yield c
