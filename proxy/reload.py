"""Live config files, reloaded on file change and on SIGHUP: the routing policy
(`PolicyStore`) and the proxy's token file (`proxy.auth.AuthStore`), both `WatchedFile`s.

A `WatchedFile` polls its file (mtime, size and inode first; the content hash decides) and
reloads when `reload()` is called (the proxy's entry point wires SIGHUP to it). A new file is
validated in full before it replaces anything: a file that fails, or that is missing, is
refused; the running value stays, `<kind>_refused` is logged with every issue and
`crossdc_proxy_<kind>_reloads_total{result="refused"}` counts it. An accepted file bumps
`version` (`crossdc_proxy_<kind>_version`), runs the `on_change` callbacks and logs
`<kind>_reloaded`. For the policy, kind is `policy`.

Loads run off the event loop: stat, read and parse go to a worker thread
(`asyncio.to_thread`), bounded by `load_timeout_s`, so a pathological file never freezes the
serving loop (health, Produce, SIGTERM). Every step in that thread is bounded by work, so the
thread always ends: the file is read by `crossdc.files.read_user_file` (a regular file only,
refused by its size first, never blocking on a pipe or a device, its own time bound of
`load_timeout_s`), parsed within `crossdc.yamlfile`'s limits and validated in linear time. A
load that still takes longer than `load_timeout_s` is refused; its thread finishes on its own
within those bounds, and no second load starts while it runs. A file that cannot be read (a
FIFO, `/dev/zero` behind a symlink, over the size limit, unreadable) is refused like a bad
one, once per change of the file (mode, owner and times included) or per SIGHUP.
The watch loop acts on a changed file only once it has settled: it reads it again on the
next poll and accepts or refuses it when neither its stat nor its content has moved since. An
editor or a `write_text` truncates before it writes: the empty or half-written file it leaves
for a moment is neither refused nor (when a prefix happens to be valid) applied. A new file
thus takes effect within two polls; a SIGHUP (`reload()`) acts at once. `run()` is
the watch loop (the proxy server runs it in its TaskGroup); `start()`/`stop()` run it in a task
of their own.
The blocking `reload()` (tests, tools) does the same work on the calling thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from crossdc.aio import cancelled_from_outside
from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_file
from crossdc.lifecycle import Lifecycle
from crossdc.topology import Topology
from crossdc.yamlfile import LIMITS
from proxy.policy import Policy, parse_policy

__all__ = ["PolicyStore", "WatchedFile"]

T = TypeVar("T")

_Stat = tuple[int, int, int, int, int, int]
"""st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns (a chmod or chown), st_mode."""


@dataclass(frozen=True, slots=True)
class _Verdict(Generic[T]):
    """What one look at the file found (computed in a worker thread, applied on the loop).
    kind: missing | same_stat | unchanged | seen | refused | accepted."""

    kind: str
    stat: _Stat | None = None
    digest: str | None = None
    issues: tuple[ConfigIssue, ...] = ()
    value: T | None = None


class WatchedFile(Lifecycle, Generic[T]):
    """Holds the live value parsed from a file; reloads on file change (poll mtime+size+hash,
    interval configurable, default 1 s) and on `reload()`. A file that fails validation is
    refused: the running value stays, the refusal is logged and counted.

    `parse(text, filename)` validates the file's text (ConfigError naming file, line and
    field when it is bad); `describe(value)` gives the fields logged on each accepted load;
    `kind` names the metrics and log events (`crossdc_proxy_<kind>_reloads_total`,
    `<kind>_reloaded`)."""

    def __init__(self, path: Path, kind: str, parse: Callable[[str, str], T], *,
                 describe: Callable[[T], dict[str, Any]] | None = None,
                 poll_interval_s: float = 1.0, load_timeout_s: float = 10.0,
                 registry: CollectorRegistry | None = None) -> None:
        if poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be > 0")
        if load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be > 0")
        self.load_timeout_s = load_timeout_s
        self.path = Path(path)
        self.kind = kind
        self._parse = parse
        self._describe = describe or (lambda _: {})
        self.poll_interval_s = poll_interval_s
        self.registry = registry if registry is not None else CollectorRegistry()
        self.on_change: list[Callable[[T], None]] = []
        self._reloads = Counter(f"crossdc_proxy_{kind}_reloads", f"{kind.capitalize()} file "
                                "loads by result (accepted, refused)", ["result"],
                                registry=self.registry)
        self._version_gauge = Gauge(f"crossdc_proxy_{kind}_version", f"Version of the live "
                                    f"{kind} file (+1 per accepted reload)",
                                    registry=self.registry)
        for result in ("accepted", "refused"):
            self._reloads.labels(result=result)
        self._value: T | None = None
        self._version = 0
        self._digest: str | None = None     # hash of the live file's content
        self._seen_stat: _Stat | None = None
        self._seen_digest: str | None = None  # last content looked at (accepted or refused)
        # A changed file seen once, as (stat, digest): acted on when the next look finds it so.
        self._settling: tuple[_Stat, str | None] | None = None
        self._missing = False
        self._task: asyncio.Task[None] | None = None
        self._loading: asyncio.Task[_Verdict[T]] | None = None  # the load in a thread
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._log = structlog.get_logger(f"crossdc.proxy.{kind}").bind(
            **{kind: str(self.path)})

    @property
    def current(self) -> T:
        """The live value; RuntimeError before the first successful load."""
        if self._value is None:
            raise RuntimeError(f"no {self.kind} loaded yet: call start() first")
        return self._value

    @property
    def version(self) -> int:
        """0 before the first load, then +1 per accepted (re)load."""
        return self._version

    @property
    def digest(self) -> str | None:
        """SHA-256 of the live file's content."""
        return self._digest

    def reload(self) -> bool:
        """Read the file now, blocking the calling thread (tests, tools; the server uses
        `reload_async`). True if new content was accepted; False if the content is what is
        live already, or if the file was refused (the old one stays)."""
        return self._apply(self._examine(force=True), force=True)

    async def reload_async(self) -> bool:
        """`reload()` off the event loop (SIGHUP), bounded by `load_timeout_s`."""
        return await self._check(force=True)

    async def load(self) -> None:
        """The first load (ConfigError if the file is bad or too slow to load: nothing to
        fall back on); off the loop. Does nothing once a value is loaded."""
        self._check_open()
        async with self._lock:
            if self._value is not None:
                return
            verdict = await self._in_thread(force=True)
            if verdict.kind != "accepted":
                issues = list(verdict.issues) or [ConfigIssue(
                    str(self.path), None, "", "not loaded")]
                self._refused(issues)
                raise ConfigError(issues)
            assert verdict.stat is not None
            assert verdict.digest is not None
            self._seen_stat, self._seen_digest = verdict.stat, verdict.digest
            self._accept(verdict.value, verdict.digest, first=True)  # type: ignore[arg-type]

    async def start(self) -> None:
        """Load the file (ConfigError if it is bad: nothing to fall back on) and start
        watching it in a task. A second call does nothing; after stop() it raises
        `Closed`."""
        if not self._begin_start():
            return
        try:
            await self.load()
        except BaseException:
            self._start_undone()
            raise
        self._task = asyncio.create_task(self.run(),
                                         name=f"proxy:{self.kind}-watch:{self.path}")

    async def stop(self) -> None:
        """Stop watching (and a load still running). Idempotent; fine before start()."""
        self._begin_stop()
        self._stop.set()
        loading, self._loading = self._loading, None
        if loading is not None and not loading.done():
            loading.cancel()  # the thread finishes on its own; nobody waits for it
            await asyncio.wait({loading})
        task, self._task = self._task, None
        if task is None:
            return
        try:
            await task
        except asyncio.CancelledError:
            if task.cancelled() and not cancelled_from_outside():
                return  # the watcher was cancelled by someone else; we were not
            raise

    async def run(self) -> None:
        """The watch loop: look at the file every `poll_interval_s` until cancelled or
        stopped (start() loads the file first; so must a caller of run())."""
        try:
            while not self._stop.is_set():
                try:
                    async with asyncio.timeout(self.poll_interval_s):  # no task per round
                        await self._stop.wait()
                except TimeoutError:
                    await self._check(force=False)
        except asyncio.CancelledError:
            self._log.debug(f"{self.kind}_watch_cancelled")
            raise
        except Exception:
            self._log.exception(f"{self.kind}_watch_failed")
            raise

    # -- internals ---------------------------------------------------------------------

    async def _check(self, *, force: bool) -> bool:
        async with self._lock:
            if self._loading is not None:  # an earlier load overran its bound
                if not self._loading.done():
                    if force:
                        self._refused([ConfigIssue(str(self.path), None, "",
                                                   "an earlier load is still running")])
                    return False
                self._loading = None
            return self._apply(await self._in_thread(force=force), force=force)

    async def _in_thread(self, *, force: bool) -> _Verdict[T]:
        """`_examine` in a worker thread, bounded by `load_timeout_s`. On timeout the
        thread is left to finish (it cannot be stopped); `_check` starts no other meanwhile
        and the file is refused."""
        task = asyncio.ensure_future(asyncio.to_thread(self._examine, force=force))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.load_timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            self._loading = task
            task.add_done_callback(_retrieve)
            return _Verdict("refused", None, None, (ConfigIssue(
                str(self.path), None, "", f"loading took longer than "
                f"{self.load_timeout_s:g}s; refused"),))
        return task.result()

    def _examine(self, *, force: bool) -> _Verdict[T]:
        """Stat, read and parse the file, comparing with what was seen; changes nothing
        (runs in a worker thread while the lock keeps the state still)."""
        try:
            stat = self._stat()
        except ConfigError as exc:
            return _Verdict("missing", issues=tuple(exc.issues))
        if not force and not self._missing and stat == self._seen_stat:
            return _Verdict("same_stat")
        try:
            text, digest = self._read()
        except ConfigError as exc:  # not a regular file, too big, unreadable: said once
            return _Verdict("refused", stat, None, tuple(exc.issues))  # per change of stat
        if digest == self._digest:
            return _Verdict("unchanged", stat, digest)
        if digest == self._seen_digest and not force:
            return _Verdict("seen", stat, digest)
        try:
            value = self._parse(text, str(self.path))
        except ConfigError as exc:
            return _Verdict("refused", stat, digest, tuple(exc.issues))
        return _Verdict("accepted", stat, digest, value=value)

    def _apply(self, v: _Verdict[T], *, force: bool) -> bool:
        """Act on what `_examine` found (on the loop). True if a new value was accepted."""
        if v.kind == "missing":
            if self._missing and not force:
                return False  # refused once already; say it again only when asked
            self._missing = True
            self._seen_stat = self._seen_digest = None
            self._refused(list(v.issues))
            return False
        if v.kind == "same_stat":
            return False
        if v.stat is None:  # a load that overran its bound
            self._refused(list(v.issues))
            return False
        self._missing = False
        if v.kind in ("refused", "accepted") and not force and (
                (v.stat, v.digest) != self._settling):
            # Maybe a write in progress: look again next poll, act if it stays as it is.
            self._settling = (v.stat, v.digest)
            self._log.debug(f"{self.kind}_settling", result=v.kind)
            return False
        self._settling = None
        self._seen_stat = v.stat
        if v.kind == "unchanged":
            self._seen_digest = v.digest
            if force:
                self._log.info(f"{self.kind}_unchanged", version=self._version)
            return False
        if v.kind == "seen":
            return False  # the same refused content, touched again
        self._seen_digest = v.digest
        if v.kind == "refused":
            self._refused(list(v.issues))
            return False
        assert v.digest is not None
        self._accept(v.value, v.digest, first=False)  # type: ignore[arg-type]
        return True

    def _stat(self) -> _Stat:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise ConfigError([ConfigIssue(str(self.path), None, "", "file not found")]
                              ) from None
        except OSError as exc:
            raise ConfigError([ConfigIssue(str(self.path), None, "", f"cannot stat: {exc}")]
                              ) from exc
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                st.st_mode)

    def _read(self) -> tuple[str, str]:
        data = read_user_file(self.path, max_bytes=LIMITS.max_bytes,
                              timeout_s=self.load_timeout_s)
        digest = hashlib.sha256(data).hexdigest()
        try:
            return data.decode("utf-8"), digest
        except UnicodeDecodeError as exc:
            raise ConfigError([ConfigIssue(str(self.path), None, "", f"not UTF-8: {exc}")]
                              ) from None

    def _accept(self, value: T, digest: str, *, first: bool) -> None:
        self._value, self._digest = value, digest
        self._version += 1
        self._reloads.labels(result="accepted").inc()
        self._version_gauge.set(self._version)
        event = f"{self.kind}_loaded" if first else f"{self.kind}_reloaded"
        self._log.info(event, version=self._version, sha256=digest[:12],
                       **self._describe(value))
        if first:
            return  # the first load is no change: callbacks are for reloads
        for callback in list(self.on_change):
            try:
                callback(value)
            except Exception:
                # One broken subscriber must not stop the others or the watcher.
                self._log.exception(f"{self.kind}_callback_failed", version=self._version,
                                    callback=getattr(callback, "__qualname__", repr(callback)))

    def _refused(self, issues: list[ConfigIssue]) -> None:
        self._reloads.labels(result="refused").inc()
        self._log.warning(f"{self.kind}_refused", version=self._version,
                          issues=[str(i) for i in issues])


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done callback of an abandoned load: take its outcome so nothing logs it as lost."""
    if not task.cancelled():
        task.exception()


class PolicyStore(WatchedFile[Policy]):
    """The live routing policy (`crossdc_proxy_policy_*` metrics, `policy_*` events)."""

    def __init__(self, path: Path, topology: Topology | None = None, *,
                 poll_interval_s: float = 1.0, load_timeout_s: float = 10.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.topology = topology
        super().__init__(path, "policy", self._parse_policy, describe=_describe_policy,
                         poll_interval_s=poll_interval_s, load_timeout_s=load_timeout_s,
                         registry=registry)

    def _parse_policy(self, text: str, filename: str) -> Policy:
        return parse_policy(text, filename, self.topology)



def _describe_policy(policy: Policy) -> dict[str, Any]:
    return {"rules": len(policy.rules), "default": policy.default is not None,
            "strict": policy.strict}
