"""The idempotency window: a client key seen again within `window_s` returns the first
result instead of writing twice; a duplicate arriving while the first is still being written
waits for it. A failed first attempt is forgotten (the retry writes), except what a partial
sync write already put somewhere: the retry resumes from there (`partial`), so no region gets
the record twice. Those partial writes are kept like results: for `window_s` after the failed
attempt and at most `max_keys` of them (oldest forgotten first).

Memory: a finished key is kept as one plain tuple (result, finished at) under its (topic,
key) tuple — no per-key object with an asyncio.Event (that is made only for a key that
another request waits on while it is being written). The router stores results as tuples of
strings and ints, which the cyclic collector stops tracking, so a full window costs RSS but
not collector time. Measured ~0.5 KB of RSS per remembered key with 36-character keys (it
was ~1.9 KB with a Slot and an Event per key)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["IdempotencyWindow", "Slot"]


class Slot:
    """One claim of a key. `owner` True: the caller writes, then calls `finish` or `fail`
    (`partial` carries region writes of an earlier failed attempt, to resume from). False:
    `result` is the first attempt's result."""

    __slots__ = ("_event", "key", "owner", "partial", "result")

    def __init__(self, key: tuple[str, str], *, result: Any = None, partial: Any = None,
                 owner: bool = True) -> None:
        self.key = key
        self.result = result
        self.partial = partial
        self.owner = owner
        self._event: asyncio.Event | None = None

    async def wait(self) -> None:
        """Until the owner finishes or fails (made only when someone waits)."""
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    def _release(self) -> None:
        if self._event is not None:
            self._event.set()


class IdempotencyWindow:
    def __init__(self, window_s: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        # key -> slot being written now
        self._inflight: dict[tuple[str, str], Slot] = {}
        # key -> (result, when finished); insertion order = age order
        self._done: OrderedDict[tuple[str, str], tuple[Any, float]] = OrderedDict()
        # key -> (partial writes, when the attempt failed); insertion order = age order
        self._partials: OrderedDict[tuple[str, str], tuple[Any, float]] = OrderedDict()
        # no entry can expire before this (the oldest entry's time + window_s)
        self._expire_at = float("inf")

    def __len__(self) -> int:
        return len(self._done) + len(self._inflight)

    def _expire(self, now: float) -> None:
        self._expire_at = float("inf")
        partials = self._partials
        while partials:
            _, failed_at = next(iter(partials.values()))
            if now - failed_at > self.window_s or len(partials) > self.max_keys:
                partials.popitem(last=False)
            else:
                self._expire_at = failed_at + self.window_s
                break
        done = self._done
        while done:
            _, finished_at = next(iter(done.values()))
            if now - finished_at > self.window_s or \
                    len(done) + len(self._inflight) > self.max_keys:
                done.popitem(last=False)
            else:
                self._expire_at = min(self._expire_at, finished_at + self.window_s)
                break

    def claim_nowait(self, topic: str, key: str) -> Slot | None:
        """The slot for (topic, key) without waiting, or None when the key is being written
        now (then `claim` waits for that write)."""
        k = (topic, key)
        now = self._clock()
        if now > self._expire_at:
            self._expire(now)
        done = self._done.get(k)
        if done is not None:
            return Slot(k, result=done[0], owner=False)
        if k in self._inflight:
            return None
        kept = self._partials.get(k) if self._partials else None
        slot = Slot(k, partial=kept[0] if kept is not None else None)
        self._inflight[k] = slot
        return slot

    async def claim(self, topic: str, key: str) -> Slot:
        """The slot for (topic, key). `slot.owner` True: the caller writes, then calls
        `finish` or `fail`. False: `slot.result` is the first attempt's result. Waits while
        another request writes the same key."""
        while True:
            slot = self.claim_nowait(topic, key)
            if slot is not None:
                return slot
            # being written: wait for it, then take its result (or the key, if it failed)
            await self._inflight[(topic, key)].wait()

    def finish(self, slot: Slot, result: Any) -> None:
        slot.result = result
        k = slot.key
        if self._inflight.get(k) is slot:
            del self._inflight[k]
        if slot.partial is not None:
            self._partials.pop(k, None)
        now = self._clock()
        done = self._done
        done[k] = (result, now)  # not there: claim_nowait answers from it before claiming
        if now + self.window_s < self._expire_at:
            self._expire_at = now + self.window_s
        if len(done) + len(self._inflight) > self.max_keys:
            done.popitem(last=False)
        if slot._event is not None:
            slot._event.set()

    def fail(self, slot: Slot, partial: Any = None) -> None:
        """The attempt failed; `partial` (if any) is kept for the next attempt to resume."""
        if self._inflight.get(slot.key) is slot:
            del self._inflight[slot.key]
        if partial:
            now = self._clock()
            self._partials.pop(slot.key, None)  # re-inserted last: its age starts now
            self._partials[slot.key] = (partial, now)
            if now + self.window_s < self._expire_at:
                self._expire_at = now + self.window_s
            if len(self._partials) > self.max_keys:
                self._partials.popitem(last=False)
        else:
            self._partials.pop(slot.key, None)
        slot._release()
