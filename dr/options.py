"""Typed options of the `dr` commands (and of `python -m dr.reconcile`, which must not load
`dr.cli`): ports, seconds, counts, hosts and names, each range- or form-checked the same way,
so that a value out of its range or not of its form is one line naming the option, exit 2,
before any work. Numbers get both bounds (typer checks them through pydantic, which then
also refuses `nan` and `inf`)."""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from dr.exits import fail

__all__ = ["MAX_COUNT", "MAX_PORT", "MAX_SECONDS", "MAX_TEXT", "TopologyOpt", "check_bindable",
           "check_folder", "check_writable_folder", "count_option", "host_option",
           "name_option", "port_option", "seconds_option", "text_option"]

MAX_PORT = 65535
MAX_SECONDS = 7 * 24 * 3600.0
"""The longest any seconds option may be (a week): beyond it, a typo or an overflow."""
MAX_COUNT = 2**63 - 1
"""The largest count (records, duplicates): Kafka's offsets are signed 64-bit."""

TopologyOpt = Annotated[Path | None, typer.Option(
    "--topology", "-t", help="Topology file [default: the running stack's, else "
    "policies/topology.local.yaml].", show_default=False)]
"""`--topology` (here, not in `dr.cli._common`: `dr consume` starts without the stack's
modules)."""


def port_option(*decls: str, **kw: Any) -> Any:
    """A TCP port option: 0-65535 (0: any free port); anything else is refused by name."""
    return typer.Option(*decls, min=0, max=MAX_PORT, **kw)


def seconds_option(*decls: str, min: float = 0.0, max: float = MAX_SECONDS,
                   **kw: Any) -> Any:
    """A duration in seconds, `min`..`max` (both bounds given, so nan and inf are refused
    too)."""
    return typer.Option(*decls, min=min, max=max, **kw)


def count_option(*decls: str, min: int = 0, max: int = MAX_COUNT, **kw: Any) -> Any:
    """A count (records, items), `min`..`max`."""
    return typer.Option(*decls, min=min, max=max, **kw)


_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?$")


def _host(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value
    except ValueError:
        pass
    if not _HOSTNAME.match(value):
        raise typer.BadParameter(f"{value!r} is not an IP address or a host name")
    return value


def host_option(*decls: str, **kw: Any) -> Any:
    """A bind address or host name: an IPv4/IPv6 address or an RFC 1123 host name."""
    return typer.Option(*decls, callback=_host, **kw)


_MAX_NAME = 249


def _name(value: Any) -> Any:
    if value is None:
        return None
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if not v or len(v) > _MAX_NAME or any(c.isspace() or not c.isprintable() for c in v):
            raise typer.BadParameter(f"{v!r} is not a name: 1 to {_MAX_NAME} printable "
                                     "characters, no spaces")
    return value


def name_option(*decls: str, **kw: Any) -> Any:
    """An identifier (a group, a worker id, a dr-id): 1-249 printable characters, no spaces."""
    return typer.Option(*decls, callback=_name, **kw)


MAX_TEXT = 1000


def _text(value: str | None) -> str | None:
    if value is None:
        return None
    if len(value) > MAX_TEXT:
        raise typer.BadParameter(f"{len(value)} characters; at most {MAX_TEXT}")
    if any(not c.isprintable() for c in value):
        raise typer.BadParameter("control characters (a new line, an escape) are not allowed")
    return value


def text_option(*decls: str, **kw: Any) -> Any:
    """Free text kept in a record (a reason): one line, at most 1000 characters."""
    return typer.Option(*decls, callback=_text, **kw)


def check_folder(folder: Path | None, option: str) -> None:
    """A folder option naming something that exists and is not a folder: bad input, one line
    naming the option (exit 2), before any work."""
    if folder is not None and folder.exists() and not folder.is_dir():
        fail(f"{option} {folder}: is a file, not a folder")


def check_writable_folder(folder: Path, option: str) -> None:
    """A folder the run will write into: made (with its parents) and a file written there
    now, so a run never ends unable to save. One line naming `option` (a flag, or the file
    field it came from): exit 2 when it is a file, exit 1 when the system refuses."""
    check_folder(folder, option)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".crossdc-probe-"):
            pass
    except OSError as exc:
        fail(f"{option} {folder}: cannot write there ({exc.strerror or exc})", 1)


def check_bindable(host: str, port: int | None, what: str, *, host_from: str,
                   port_fix: str) -> None:
    """Refuse before anything starts when a server of the command cannot bind `host:port`.
    A host that does not resolve, or is no address of this machine, is said as such naming
    where it came from (`host_from`: `--http-host`, `ctl.yaml http_host`; exit 2, the input
    is wrong), never as a port that is not free; a port in use names the port and how to
    pick another (`port_fix`: `pass --metrics-port`; exit 1, the machine is at fault).
    Port 0 or None: only the address is checked (the server takes any free port)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port or 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        fail(f"{host_from} {host}: the host does not resolve ({exc.strerror or exc})")
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # servers bind with SO_REUSEADDR: a socket lingering in TIME_WAIT is no conflict
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                fail(f"{host_from} {host}: {addr[0]} is not an address of this machine "
                     f"({exc.strerror or exc})")
            fail(f"the {what} port {host}:{port} is not free ({exc.strerror or exc}); stop "
                 f"what holds it or {port_fix}", 1)
