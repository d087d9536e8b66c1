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
)
from tenacity.wait import wait_base

from crossdc.errors import CrossdcError
from crossdc_client.backoff import Backoff as _Backoff

__all__ = ["Backoff", "RetrySettings", "retriable"]


def retriable(exc: BaseException) -> bool:
    """Whether retrying can help: the error's class says so (`CrossdcError.retriable`)."""
    return isinstance(exc, CrossdcError) and exc.retriable


@dataclass(frozen=True)
class Backoff(_Backoff):
    """The one backoff (`crossdc_client.backoff.Backoff`: pauses that double from `first_s`
    up to `max_s`, with up to `jitter_s` added; the SDK's retries use it too), and `wait()`:
    the same pauses as the tenacity wait strategy of the retry loops."""

    def wait(self) -> wait_base:
        """The tenacity wait strategy (`AsyncRetrying(wait=...)`): `pause(attempt)`."""
        return _PauseWait(self)


class _PauseWait(wait_base):
    def __init__(self, backoff: _Backoff) -> None:
        self.backoff = backoff

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.backoff.pause(retry_state.attempt_number)


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
