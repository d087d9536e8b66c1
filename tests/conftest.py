"""Markers by path, and guards that make leaks fail.

Leak guard (autouse, every test): a test that leaves asyncio tasks it created still pending, or
drops a client without closing it (aiokafka producers/consumers, aiohttp sessions behind
py-consul: their `__del__` raises ResourceWarning, an error under `filterwarnings = error`),
fails, naming what leaked.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dr.stack.ports import SLICE_ENV

LEAK_GRACE_S = 2.0
"""How long tasks cancelled at a test's end may take to finish before they count as leaked."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "chaos" in parts:
            item.add_marker(pytest.mark.chaos)
        elif "integration" in parts:
            item.add_marker(pytest.mark.integration)
        elif "unit" in parts:
            item.add_marker(pytest.mark.unit)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker picks free ports from a slice of its own (dr.stack.ports)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit():
        os.environ[SLICE_ENV] = f"{int(worker[2:])}/{count}"
    _kafka_client_default()


KAFKA_CLIENT_ENV = "CROSSDC_TEST_KAFKA_CLIENT"
"""`CROSSDC_TEST_KAFKA_CLIENT=librdkafka pytest tests/integration/test_proxy*.py`: every
proxy a test builds in this process (`KafkaWriterSettings` without `client`) writes with that
client (proxy.config `KafkaWriterSettings.client`), and so does every `dr proxy serve` a test
starts (its `--kafka-client` from $CROSSDC_PROXY_KAFKA_CLIENT). The mirror too: every `Flow`
built in this process (without `kafka_client`) copies with that client (both modes), and
`dr mirror run` processes started by the tests read it from CROSSDC_MIRROR_KAFKA_CLIENT (its
--kafka-client). `CROSSDC_TEST_MIRROR_CONSUMER=librdkafka` does the same for the mirror's
consumer (`Flow.consumer_client`, both modes, aiokafka by default;
CROSSDC_MIRROR_CONSUMER_CLIENT for `dr mirror run`)."""

MIRROR_CONSUMER_ENV = "CROSSDC_TEST_MIRROR_CONSUMER"
FENCED_ENV = "CROSSDC_TEST_FENCED_WRITES"
"""`CROSSDC_TEST_FENCED_WRITES=1` (=0): every proxy a test builds in this process
(`KafkaWriterSettings` without `fenced_writes`) and every `dr proxy serve` a test starts
(CROSSDC_PROXY_FENCED_WRITES) writes ordered and sync records in transactions
(proxy/fenced.py), or plainly; unset, the default (`proxy.config.FENCED_BY_DEFAULT`, on)."""


def _kafka_client_default() -> None:
    from crossdc.topology import Flow, Topology

    fenced = os.environ.get(FENCED_ENV, "")
    if fenced:
        import proxy.config
        from proxy.config import KafkaWriterSettings, ProxyConfig

        on = fenced != "0"
        os.environ["CROSSDC_PROXY_FENCED_WRITES"] = "1" if on else "0"
        proxy.config.FENCED_BY_DEFAULT = on
        ProxyConfig.model_fields["kafka"].default = KafkaWriterSettings()
        ProxyConfig.model_rebuild(force=True)

    consumer = os.environ.get(MIRROR_CONSUMER_ENV, "")
    if consumer:
        os.environ["CROSSDC_MIRROR_CONSUMER_CLIENT"] = consumer
        Flow.model_fields["consumer_client"].default = consumer
        Flow.model_rebuild(force=True)
        Topology.model_rebuild(force=True)
    client = os.environ.get(KAFKA_CLIENT_ENV, "")
    if not client:
        return
    from proxy.config import KafkaWriterSettings, ProxyConfig

    os.environ["CROSSDC_PROXY_KAFKA_CLIENT"] = client  # `dr proxy serve` processes
    Flow.model_fields["kafka_client"].default = client
    Flow.model_rebuild(force=True)
    Topology.model_rebuild(force=True)
    os.environ["CROSSDC_MIRROR_KAFKA_CLIENT"] = client
    KafkaWriterSettings.model_fields["client"].default = client
    KafkaWriterSettings.model_rebuild(force=True)
    ProxyConfig.model_fields["kafka"].default = KafkaWriterSettings()
    ProxyConfig.model_rebuild(force=True)


# Integration modules run on the worker of the unit tests, beside the session stack's worker:
# those that start every server they need themselves, and (the last two) modules of the
# session stack that mostly wait (failovers, leases): that worker starts a session stack of
# its own for them, and `make test` ends about a minute and a half sooner (measured: the
# stack's worker had 647 s of tests, the other 419 s).
OWN_SERVERS = ("tests/integration/test_services.py", "tests/integration/test_prometheus.py",
               "tests/integration/test_stack_variants.py",
               "tests/integration/test_hostile_files.py",
               "tests/integration/test_docker_stack.py",
               "tests/integration/test_kafka_security.py",
               "tests/integration/test_controller.py", "tests/integration/test_lease.py",
               "tests/integration/test_fenced_writes.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs on two workers (`pytest -n 2`): one runs every test that needs the
    session's stack, in order, so it starts once; the other runs the modules of `OWN_SERVERS`
    (one after the other) and the unit tests beside it. (xdist's
    `--dist loadgroup` would do this with a mark, but it renames node ids in a way pytest 9
    no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ServersOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(OWN_SERVERS):
                return "own-servers"
            if nodeid.startswith(("tests/integration/", "tests/chaos/")):
                return "servers"
            return nodeid  # each unit test on its own: the idle worker takes the next

    return ServersOnOneWorker(config, log)


def _task_name(t: asyncio.Task[object]) -> str:
    coro = t.get_coro()
    where = getattr(coro, "__qualname__", repr(coro))
    # Who owns it: a client's id and servers say which client was left open.
    frame = getattr(coro, "cr_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    hints = [f"{k}={getattr(owner, k)!r}" for k in ("_client_id", "_bootstrap_servers")
             if owner is not None and hasattr(owner, k)]
    return f"{t.get_name()} ({where}{'; ' + ', '.join(hints) if hints else ''})"


async def pending_tasks_since(before: set[asyncio.Task[object]],
                              grace_s: float = LEAK_GRACE_S) -> list[str]:
    """Tasks made after `before` was taken that are still pending after `grace_s`."""
    me = asyncio.current_task()
    deadline = time.monotonic() + grace_s
    while True:
        left = [t for t in asyncio.all_tasks() if t not in before and t is not me
                and not t.done()]
        if not left or time.monotonic() > deadline:
            return [_task_name(t) for t in left]
        # Waiting on the tasks themselves (not a sleep): wake when one finishes.
        await asyncio.wait(left, timeout=max(0.0, deadline - time.monotonic()))


@pytest.fixture(autouse=True)
async def _no_leaked_tasks(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    if request.node.get_closest_marker("allow_leaks"):
        yield
        return
    before = set(asyncio.all_tasks())
    yield
    leaked = await pending_tasks_since(before)
    if leaked:
        pytest.fail(f"test left {len(leaked)} asyncio task(s) pending: {', '.join(leaked)}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _no_unclosed_clients() -> Iterator[None]:
    yield
    # Collect now so an unclosed client's ResourceWarning is raised inside this test's
    # teardown (an error under filterwarnings=error), not in some later test.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    if leaks:
        pytest.fail(f"test left {len(leaks)} client(s) unclosed: {'; '.join(leaks[:5])}",
                    pytrace=False)
