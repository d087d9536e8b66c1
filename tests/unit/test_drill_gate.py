"""The drill injects a failover scenario's fault only once the controller's own rules would
let the standby take over (a mirror that copied nothing lately, with records pending, makes
it refuse the failover for the whole fault)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dr.controller.errors import FailoverRefused
from dr.drill import run as drill_run
from dr.drill.errors import DrillError


def _plans(monkeypatch: pytest.MonkeyPatch, answers: list[Exception | None]) -> list[str]:
    asked: list[str] = []

    async def plan_failover(topology: Any, dcs: Any, settings: Any, target: str,
                            **kw: Any) -> object:
        asked.append(target)
        answer = answers.pop(0) if answers else None
        if answer is not None:
            raise answer
        return object()
    monkeypatch.setattr(drill_run, "plan_failover", plan_failover)
    monkeypatch.setattr("dr.drill.run.asyncio.sleep", _no_wait)
    return asked


async def _no_wait(_: float) -> None:
    return None


async def test_waits_while_the_mirror_is_behind_then_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    behind = FailoverRefused("target-behind", "the mirror into west last copied 13162 s ago")
    asked = _plans(monkeypatch, [behind, behind, None])
    said: list[str] = []
    await drill_run._mirror_copying(None, None, None, "west",  # type: ignore[arg-type]
                                    time.monotonic() + 30, said.append, None)
    assert asked == ["west"] * 3
    [said_once] = said
    assert "waiting for the mirror into west" in said_once


async def test_another_refusal_is_left_to_the_drill(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _plans(monkeypatch, [FailoverRefused("no-majority", "only 1 of 3 answer")])
    await drill_run._mirror_copying(None, None, None, "west",  # type: ignore[arg-type]
                                    time.monotonic() + 30, lambda s: None, None)
    assert asked == ["west"]


async def test_a_mirror_that_never_catches_up_fails_the_drill_by_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    behind = FailoverRefused("target-behind", "west is 20000 record(s) behind east")
    _plans(monkeypatch, [behind] * 5)
    with pytest.raises(DrillError, match="would refuse a failover to west"):
        await drill_run._mirror_copying(None, None, None, "west",  # type: ignore[arg-type]
                                        time.monotonic() - 1, lambda s: None, None)
