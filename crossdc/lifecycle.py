"""One lifecycle for every long-lived object: `start()`, `stop()`, `async with`, one error
for "it was stopped", and a `ResourceWarning` for one that was started and never stopped.

Defined in the client distribution (`crossdc_client.lifecycle`: the SDK's producer and
consumer are Lifecycles) and re-exported here; see that module for the contract.
"""

from __future__ import annotations

from crossdc_client.lifecycle import Closed, Lifecycle

__all__ = ["Closed", "Lifecycle"]
