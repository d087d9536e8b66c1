"""Read a file a user named, within bounds: the one way crossdc reads what it is handed.

Every file a user or an operator names (topology, policy, auth, drill and controller
settings, TLS material, password files, saved reconciliation state) is read by
`read_user_file`, which

- refuses anything but a regular file, symlinks resolved: a named pipe (FIFO), a device
  (`/dev/zero`, a terminal), a socket or a directory is refused at once with an error naming
  the file and what it is, instead of blocking on a pipe that has no writer or reading a
  device that never ends;
- refuses a file larger than `max_bytes` by its size, before reading it;
- opens with `O_NONBLOCK`, so a FIFO swapped in between the look and the open cannot make the
  open wait for a writer, and checks the open descriptor again (`fstat`): what is read is
  the regular file that was checked;
- reads at most `max_bytes + 1` bytes, in chunks, so a file that grows while it is read is
  refused rather than followed;
- holds a time bound between chunks (`timeout_s`).

Why the time bound needs no thread (and so cannot leave one behind): `read(2)` on a regular
file never waits for a writer or for more data; it copies what the page cache holds or what
the disk returns, and at end of file it returns 0. With the descriptor known to be a regular
file, every call returns after a bounded amount of work (one chunk), and the deadline is
checked between calls, in the caller's own thread. The one case no user-space bound can
cover is storage that stops answering (a hung NFS server, a stalled FUSE daemon): the
kernel then sleeps in `read(2)` uninterruptibly, and a helper thread would be stuck the same
way, only hidden; there is no such wait on local storage.

The error is `ConfigError` with one `ConfigIssue` (the file, the field when the caller names
one, the message), so a command prints it as one line and exits 65. Imports nothing but the
standard library and the errors beside it (moved here from `crossdc.files`, which re-exports
it, so that the client SDK reads its TLS files the same way).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

from crossdc_client.errors import ConfigError, ConfigIssue

__all__ = ["CHUNK_BYTES", "read_user_file", "read_user_text", "too_big"]

CHUNK_BYTES = 256 * 1024
"""Bytes per read(2) call; the deadline is checked between calls."""


def read_user_file(path: str | os.PathLike[str], *, max_bytes: int, timeout_s: float,
                   field: str = "") -> bytes:
    """The content of the regular file `path` (symlinks followed), at most `max_bytes`.

    ConfigError (one issue naming `path`, and `field` when given) when the file is missing,
    not a regular file (FIFO, device, socket, directory), larger than `max_bytes`, unreadable,
    or not read within `timeout_s` seconds. Never blocks on a FIFO or a device; reads in the
    calling thread (see the module docstring for why that bound holds)."""
    if max_bytes < 0:
        raise ValueError("max_bytes must be >= 0")
    if timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    name = os.fspath(path)
    deadline = time.monotonic() + timeout_s

    def refuse(message: str) -> ConfigError:
        return ConfigError([ConfigIssue(name, None, field, message)])

    try:
        st = os.stat(name)  # follows symlinks: what a read would reach
    except FileNotFoundError:
        raise refuse("file not found") from None
    except OSError as exc:
        raise refuse(_os_message(exc)) from None
    if not stat.S_ISREG(st.st_mode):
        raise refuse(_not_regular(name, st.st_mode))
    if st.st_size > max_bytes:
        raise refuse(too_big(st.st_size, max_bytes))
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | \
        getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(name, flags)
    except FileNotFoundError:
        raise refuse("file not found") from None
    except OSError as exc:
        raise refuse(_os_message(exc)) from None
    try:
        st = os.fstat(fd)  # the file now open, not the one looked at before (a swap)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(_not_regular(name, st.st_mode))
        if st.st_size > max_bytes:
            raise refuse(too_big(st.st_size, max_bytes))
        chunks: list[bytes] = []
        got = 0
        while got <= max_bytes:
            if time.monotonic() > deadline:
                raise refuse(f"reading it took longer than {timeout_s:g}s")
            try:
                chunk = os.read(fd, min(CHUNK_BYTES, max_bytes + 1 - got))
            except BlockingIOError:  # not on a regular file; refused rather than waited on
                raise refuse("the file would block (not a regular file?)") from None
            except OSError as exc:
                raise refuse(_os_message(exc)) from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:  # it grew while it was read
            raise refuse(f"the file grew past the limit of {max_bytes} bytes while it "
                         "was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_user_text(path: str | os.PathLike[str], *, max_bytes: int, timeout_s: float,
                   field: str = "") -> str:
    """`read_user_file` decoded as UTF-8 (ConfigError naming the byte offset if it is not)."""
    data = read_user_file(path, max_bytes=max_bytes, timeout_s=timeout_s, field=field)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue(os.fspath(path), None, field,
                                       f"not UTF-8 text (byte {exc.start})")]) from None


def too_big(size: int, max_bytes: int) -> str:
    """The refusal of a file (or text) over its size limit."""
    mib = f" ({max_bytes / 1024 / 1024:g} MiB)" if max_bytes >= 1024 * 1024 else ""
    return f"the file is {size} bytes; the limit is {max_bytes} bytes{mib}"


def _not_regular(name: str, mode: int) -> str:
    kind = ("a directory" if stat.S_ISDIR(mode) else
            "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a file")
    target = ""
    if Path(name).is_symlink():
        try:
            target = f" (a link to {os.path.realpath(name)})"
        except (OSError, ValueError):
            target = " (a link)"
    return f"is {kind}{target}, not a regular file; refused"


def _os_message(exc: OSError) -> str:
    if exc.errno == errno.EACCES:
        return "cannot read: permission denied"
    return f"cannot read: {exc.strerror or exc.__class__.__name__}"
