"""Server processes that outlive the CLI: start detached, find again by pid, stop in order."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from dr.errors import PortTaken, ProcessDied, StartTimeout

__all__ = ["ManagedProcess", "check_port_free", "first_error", "log_tail", "port_holder"]

log = structlog.get_logger("crossdc.stack")


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file ("(no output)" when empty or missing)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return "(no output)"
    tail = text.strip().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) if tail else "(no output)"


_CAUSE_MARKERS = ("Exception:", "Error:", "[ERR]", "ERROR", "FATAL", "error=", "panic:")


def first_error(path: Path) -> str | None:
    """The first line of a log that states an error (what a person wants to read first)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if any(m in line for m in _CAUSE_MARKERS):
            # Java puts the exception itself on the line after "ERROR ... fatal fault".
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if "Exception" in nxt and "Exception" not in line:
                return nxt
            return line.strip()
    return None


def port_holder(port: int) -> str | None:
    """Which process listens on `port`, as `name (pid N)`, when `ss` can tell."""
    try:
        out = subprocess.run(["ss", "-Hlntup", f"sport = :{port}"], capture_output=True,
                             text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if 'users:(("' in line:
            users = line.split('users:(("', 1)[1]
            name = users.split('"', 1)[0]
            pid = users.split("pid=", 1)[1].split(",", 1)[0] if "pid=" in users else "?"
            return f"{name} (pid {pid})"
    return None


def check_port_free(port: int, owner: str, field: str, *, udp: bool = False) -> None:
    """Raise PortTaken when 127.0.0.1:`port` cannot be bound (TCP, and UDP if asked)."""
    kinds = [socket.SOCK_STREAM] + ([socket.SOCK_DGRAM] if udp else [])
    for kind in kinds:
        with socket.socket(socket.AF_INET, kind) as sock:
            # Servers bind with SO_REUSEADDR, so a socket lingering in TIME_WAIT is no conflict.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise PortTaken(port, owner, field, port_holder(port)) from None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a process, from /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], fields[19]


@dataclass
class ManagedProcess:
    """One server process of the stack; its pid lives in `<workdir>/pid`."""

    name: str
    workdir: Path
    argv: list[str]
    env: dict[str, str] | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.workdir / "pid"

    def pid(self) -> int | None:
        """The pid of the running process, or None when it is not running."""
        try:
            pid_text, started = self.pid_path.read_text(encoding="utf-8").split()
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return None
        stat = _proc_stat(pid)
        # A zombie (state Z) is dead; a different start time means the pid was reused.
        if stat is None or stat[0] == "Z" or stat[1] != started:
            return None
        return pid

    def running(self) -> bool:
        return self.pid() is not None

    def start(self) -> int:
        """Start detached (own session), output appended to `server.log`; return the pid."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        with self.log_path.open("ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {self.name}\n".encode())
            out.flush()
            # posix_spawn, not Popen: the server outlives this object (and the CLI), so no
            # Popen should warn about a child "still running"; we reap it with waitpid.
            pid = os.posix_spawnp(
                self.argv[0], self.argv, env,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, out.fileno(), 1),
                              (os.POSIX_SPAWN_DUP2, out.fileno(), 2)],
                setsid=True)
        self._child = pid
        self._exit_code: int | None = None
        stat = _proc_stat(pid)
        self.pid_path.write_text(f"{pid} {stat[1] if stat else 0}", encoding="utf-8")
        log.info("process_started", process=self.name, pid=pid)
        return pid

    def check_alive(self) -> None:
        """Raise ProcessDied (with the log tail) when the process has exited."""
        self._reap()
        child = getattr(self, "_child", None)
        dead = self._exit_code is not None if child is not None else not self.running()
        if dead:
            raise ProcessDied(self.name, getattr(self, "_exit_code", None), str(self.log_path),
                              log_tail(self.log_path), first_error(self.log_path))

    def stop(self, timeout_s: float = 20.0, *, kill: bool = False) -> bool:
        """SIGTERM (SIGKILL if `kill`), wait up to `timeout_s`, then SIGKILL. True if it ran."""
        pid = self.pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL if kill else signal.SIGTERM)
            # A frozen process (SIGSTOP, a drill's fault) acts on SIGTERM only once it runs.
            os.killpg(pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        while self.pid() is not None and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.1)
        if self.pid() is not None:
            log.warning("process_kill_after_timeout", process=self.name, pid=pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            while self.pid() is not None:
                self._reap()
                time.sleep(0.05)
        self._reap()
        self.pid_path.unlink(missing_ok=True)
        log.info("process_stopped", process=self.name, pid=pid)
        return True

    def send(self, sig: signal.Signals) -> bool:
        """Send `sig` to the process (its whole process group); False when it is not running."""
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return False
        log.info("process_signalled", process=self.name, pid=pid, signal=sig.name)
        return True

    def freeze(self) -> bool:
        """SIGSTOP: the process stays, answers nothing (a hung server); False if not running."""
        return self.send(signal.SIGSTOP)

    def thaw(self) -> bool:
        """SIGCONT: a frozen process runs on; False if not running."""
        return self.send(signal.SIGCONT)

    def frozen(self) -> bool:
        """Whether the process is stopped by a signal (state T)."""
        pid = self.pid()
        stat = _proc_stat(pid) if pid is not None else None
        return stat is not None and stat[0] in ("T", "t")

    def _reap(self) -> None:
        """Collect our own child's exit status, so it does not linger as a zombie."""
        child = getattr(self, "_child", None)
        if child is None or getattr(self, "_exit_code", None) is not None:
            return
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            self._exit_code = -1
            return
        if pid:
            self._exit_code = os.waitstatus_to_exitcode(status)


async def poll_while_alive(cond: Callable[[], Awaitable[bool]], procs: Sequence[ManagedProcess],
                           deadline: float, on_timeout: Callable[[], str]) -> None:
    """Poll `cond` until true: ProcessDied as soon as one of `procs` exits, StartTimeout
    with `on_timeout()` once `deadline` (time.monotonic) passes. Backs off 0.2 s → 1 s."""
    pause = 0.2
    while True:
        for p in procs:
            p.check_alive()
        if await cond():
            return
        if time.monotonic() >= deadline:
            raise StartTimeout(on_timeout())
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, 1.0)
