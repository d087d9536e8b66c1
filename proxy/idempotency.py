"""The idempotency window: a client key seen again within `window_s` returns the first
result instead of writing twice; a duplicate arriving while the first is still being written
waits for it. A failed first attempt is forgotten (the retry writes), except what a partial
sync write already put somewhere: the retry resumes from there (`partial`), so no region gets
the record twice. Those partial writes are kept like results: for `window_s` after the failed
attempt and at most `max_keys` of them (oldest forgotten first)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IdempotencyWindow", "Slot"]


@dataclass
class Slot:
    """One key's state. `result` set when done; `partial` carries region writes of a failed
    attempt, for the next attempt to resume from."""

    key: tuple[str, str]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None
    partial: Any = None
    finished_at: float = 0.0
    owner: bool = True


class IdempotencyWindow:
    def __init__(self, window_s: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._slots: OrderedDict[tuple[str, str], Slot] = OrderedDict()
        # key -> (partial writes, when the attempt failed); insertion order = age order
        self._partials: OrderedDict[tuple[str, str], tuple[Any, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._slots)

    def _expire(self) -> None:
        now = self._clock()
        while self._partials:
            _, failed_at = next(iter(self._partials.values()))
            if now - failed_at > self.window_s or len(self._partials) > self.max_keys:
                self._partials.popitem(last=False)
            else:
                break
        while self._slots:
            slot = next(iter(self._slots.values()))
            done = slot.done.is_set()
            if done and (len(self._slots) > self.max_keys
                         or now - slot.finished_at > self.window_s):
                self._slots.popitem(last=False)
            else:
                break

    async def claim(self, topic: str, key: str) -> Slot:
        """The slot for (topic, key). `slot.owner` True: the caller writes, then calls
        `finish` or `fail`. False: `slot.result` is the first attempt's result."""
        k = (topic, key)
        while True:
            self._expire()
            slot = self._slots.get(k)
            if slot is None:
                kept = self._partials.get(k)
                slot = Slot(k, partial=kept[0] if kept is not None else None)
                self._slots[k] = slot
                return slot
            if slot.done.is_set():
                if slot.result is not None:
                    return Slot(k, result=slot.result, owner=False, done=slot.done)
                continue  # pragma: no cover - failed slots are removed in fail()
            await slot.done.wait()
            if slot.result is not None:
                return Slot(k, result=slot.result, owner=False, done=slot.done)
            # the first attempt failed: loop and claim it ourselves

    def finish(self, slot: Slot, result: Any) -> None:
        slot.result = result
        slot.finished_at = self._clock()
        self._partials.pop(slot.key, None)
        self._slots.move_to_end(slot.key)
        slot.done.set()

    def fail(self, slot: Slot, partial: Any = None) -> None:
        """The attempt failed; `partial` (if any) is kept for the next attempt to resume."""
        if self._slots.get(slot.key) is slot:
            del self._slots[slot.key]
        if partial:
            self._partials.pop(slot.key, None)  # re-inserted last: its age starts now
            self._partials[slot.key] = (partial, self._clock())
            if len(self._partials) > self.max_keys:
                self._partials.popitem(last=False)
        else:
            self._partials.pop(slot.key, None)
        slot.done.set()
