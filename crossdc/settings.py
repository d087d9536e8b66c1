"""Settings models shared by every component (each component nests them in its own config)."""

from __future__ import annotations

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

__all__ = ["RetrySettings", "retriable"]


def retriable(exc: BaseException) -> bool:
    """Whether retrying can help: the error's class says so (`CrossdcError.retriable`)."""
    return isinstance(exc, CrossdcError) and exc.retriable


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
            wait=wait_exponential_jitter(multiplier=self.backoff_initial_s,
                                         max=self.backoff_max_s, jitter=self.backoff_initial_s),
            retry=retry_if_exception(retriable), before_sleep=before_sleep, reraise=True)
