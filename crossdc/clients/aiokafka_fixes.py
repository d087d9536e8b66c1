"""A socket aiokafka leaves open when a caller's deadline cancels its start, closed here.

`AIOKafkaClient.bootstrap()` (every aiokafka client's `start()`) opens a connection, then
asks it for the cluster's metadata. Cancelled between the two (an `asyncio.timeout` around
`start()`: `dr status`'s probes, the controller's rounds, a retry's per-call deadline),
the connection is in no pool, so neither the client's `close()` nor anything else closes
it: the socket stays open until the garbage collector finds it and aiokafka reports an
unclosed connection. aiokafka 0.14 still does so (aio-libs/aiokafka#715 is the same family:
connections opened during a failed start). A broker that answers the handshake but not
the metadata request in time (starting, overloaded, cut off mid-call) is enough.

`install()` wraps `bootstrap()`: the connections it opens are noted while it runs, and
when it ends by an exception (cancellation included) the ones that did not reach the
client's pool are closed before the exception goes on. Applied once, on import of
`crossdc.clients`: every aiokafka client crossdc builds takes its arguments from there.

**OAUTHBEARER's error challenge.** A broker that refuses a token (expired, bad signature)
does not fail the SASL exchange at once: RFC 7628 §3.2.2 has it answer with an error
challenge (`{"status":"invalid_token"}`) that the client must acknowledge with a single
0x01 byte, after which the broker fails the exchange. aiokafka 0.14's `OAuthAuthenticator`
ends after sending the token, so it takes the challenge for success and sends its next
request (metadata) into the unfinished exchange: the broker closes the connection
("Unexpected Kafka request of type METADATA during SASL authentication"), while the client
has started with no brokers and times out on every call. `install()` makes the
authenticator acknowledge a challenge, so the broker's refusal comes back as aiokafka's
`SaslAuthenticationFailed` and the start fails (tests/integration/test_kafka_security.py).
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

import aiokafka.client as _client
import aiokafka.conn as _conn


class _Opened(list[Any]):
    """The connections one bootstrap opened; `active` False once it has ended (a task it
    started, the metadata synchronizer, inherits the context and must not add to it)."""

    active = True


def install() -> None:
    """Make a cancelled or failed `AIOKafkaClient.bootstrap()` close what it opened, and
    OAUTHBEARER acknowledge a broker's error challenge. Safe to call twice."""
    _install_oauth_challenge()
    if getattr(_client.AIOKafkaClient.bootstrap, "_crossdc_closes_on_failure", False):
        return
    opened_now: contextvars.ContextVar[_Opened | None] = contextvars.ContextVar(
        "crossdc_bootstrap_opened", default=None)
    create_conn = _client.create_conn
    bootstrap = _client.AIOKafkaClient.bootstrap

    @functools.wraps(create_conn)
    async def noting_create_conn(*args: Any, **kwargs: Any) -> Any:
        conn = await create_conn(*args, **kwargs)
        opened = opened_now.get()
        if opened is not None and opened.active:
            opened.append(conn)
        return conn

    @functools.wraps(bootstrap)
    async def closing_bootstrap(self: Any) -> None:
        opened = _Opened()
        token = opened_now.set(opened)
        try:
            await bootstrap(self)
        except BaseException:
            pooled = {id(c) for c in self._conns.values()}
            for conn in opened:
                if id(conn) not in pooled:
                    conn.close()
            raise
        finally:
            opened.active = False
            opened.clear()
            opened_now.reset(token)

    closing_bootstrap._crossdc_closes_on_failure = True  # type: ignore[attr-defined]
    _client.create_conn = noting_create_conn
    _client.AIOKafkaClient.bootstrap = closing_bootstrap


def _install_oauth_challenge() -> None:
    step = _conn.OAuthAuthenticator.step
    if getattr(step, "_crossdc_answers_challenge", False):
        return

    @functools.wraps(step)
    async def answering_step(self: Any, payload: Any) -> Any:
        if self._token_sent and payload:
            # the broker's error challenge (the token was refused): 0x01 ends the exchange,
            # once; the broker then answers with the failure
            if getattr(self, "_crossdc_challenge_answered", False):
                return None
            self._crossdc_challenge_answered = True
            return b"\x01", True
        return await step(self, payload)

    answering_step._crossdc_answers_challenge = True  # type: ignore[attr-defined]
    _conn.OAuthAuthenticator.step = answering_step
