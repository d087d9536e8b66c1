"""Settings models shared by every component (each component nests them in its own config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from crossdc.errors import CrossdcError

__all__ = ["Backoff", "RetrySettings", "retriable"]


def retriable(exc: BaseException) -> bool:
    """Whether retrying can help: the error's class says so (`CrossdcError.retriable`)."""
    return isinstance(exc, CrossdcError) and exc.retriable


@dataclass(frozen=True)
class Backoff:
    """Pauses that double from `first_s` up to `max_s`, each with up to `jitter_s` (default
    `first_s`) added at random: tenacity's `wait_exponential_jitter`, the one backoff of the
    retry loops (`RetrySettings.retrying`, `wait()`) and of the loops that count their own
    failures (restart supervisors, the mirror's target writes, the SDK's retries: `pause(n)`)."""

    first_s: float
    max_s: float
    jitter_s: float | None = None

    def wait(self) -> wait_exponential_jitter:
        """The tenacity wait strategy (`AsyncRetrying(wait=...)`)."""
        jitter = self.first_s if self.jitter_s is None else self.jitter_s
        return wait_exponential_jitter(multiplier=self.first_s, max=self.max_s, jitter=jitter)

    def pause(self, n: int) -> float:
        """The pause after failure number `n` (1, 2, ...)."""
        state = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        state.attempt_number = max(1, n)
        return float(self.wait()(state))


class RetrySettings(BaseModel):
    """How hard a client tries before it gives up on one call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(3, ge=1, description="Tries per call, the first included.")
    total_s: float = Field(5.0, gt=0, description="Give up after this long, whatever the tries.")
    call_timeout_s: float = Field(2.0, gt=0, description="Deadline of a single try.")
    backoff_initial_s: float = Field(0.1, gt=0, description="First pause between tries.")
    backoff_max_s: float = Field(1.0, gt=0, description="Longest pause between tries.")

    def retrying(self, log: Any, event: str, **context: object) -> AsyncRetrying:
        """The one bounded retry loop of a client: tries until an answer, an error whose
        class is not `retriable`, `attempts` or `total_s`; exponential backoff with jitter;
        each retry logged as `event` (attempt n of N, the error, `context`); the last error
        re-raised."""

        def before_sleep(rs: RetryCallState) -> None:
            log.debug(event, attempt=rs.attempt_number, of=self.attempts,
                      error=str(rs.outcome.exception() if rs.outcome else ""), **context)

        return AsyncRetrying(
            stop=stop_after_attempt(self.attempts) | stop_after_delay(self.total_s),
            wait=Backoff(self.backoff_initial_s, self.backoff_max_s).wait(),
            retry=retry_if_exception(retriable), before_sleep=before_sleep, reraise=True)
