"""Settings models shared by every component (each component nests them in its own config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RetrySettings"]


class RetrySettings(BaseModel):
    """How hard a client tries before it gives up on one call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(3, ge=1, description="Tries per call, the first included.")
    total_s: float = Field(5.0, gt=0, description="Give up after this long, whatever the tries.")
    call_timeout_s: float = Field(2.0, gt=0, description="Deadline of a single try.")
    backoff_initial_s: float = Field(0.1, gt=0, description="First pause between tries.")
    backoff_max_s: float = Field(1.0, gt=0, description="Longest pause between tries.")
