"""How a `dr` command ends: every error a user can cause becomes one readable paragraph and
an exit code, never a traceback. The codes (docs/architecture.md, "Exit codes", one table):

0 ok; 1 the command could not do its work (an error it names: a server that does not
answer, a step that failed, the system refusing a port or a path); 2 the command line (an
unknown option, a missing argument, an option's value refused); 3 it ran and judged the
system bad (`dr status` unhealthy, `dr sync status` blocking a failover, a drill breaching a
threshold, reconciliation FAIL, the demo's verdict; `dr mirror run`: fenced by a newer
worker, do not restart); 4 nothing judged yet (reconciliation); 65 a file the user wrote is
missing or invalid (policy, topology, drill, auth, thresholds: file, line and field named;
sysexits' EX_DATAERR); 130 interrupted.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from crossdc.errors import ConfigError, ConfigIssue, CrossdcError

__all__ = ["COMMAND_LINE", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_INVALID_FILE",
           "EXIT_NOT_JUDGED", "EXIT_USAGE", "EXIT_VERDICT", "Exit", "click_command", "fail",
           "fail_line", "run_app"]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_VERDICT = 3
EXIT_NOT_JUDGED = 4
EXIT_INVALID_FILE = ConfigError.exit_code  # 65
EXIT_INTERRUPTED = 130

COMMAND_LINE = "command line"
"""The `file` of a ConfigIssue about an option rather than a file."""

_err = Console(stderr=True)


class Exit(Exception):
    """End the command with `code` after its output was printed."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def fail_line(message: str) -> None:
    """Print `error: <message>` in red on stderr (one line; a long one is not wrapped)."""
    _err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """One red line and exit `code` (2: bad input)."""
    fail_line(message)
    sys.exit(code)


def _option_issue(issue: ConfigIssue) -> str:
    """An issue about an option: `--max-rto-s: ...` (file "command line", field the option)
    or `--regions mars: ...` (file the option, field the value)."""
    if issue.file == COMMAND_LINE:
        return f"{issue.field}: {issue.message}" if issue.field else issue.message
    return f"{issue.file} {issue.field}: {issue.message}" if issue.field else \
        f"{issue.file}: {issue.message}"


def _validation_line(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or exc.title
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


@functools.cache
def click_command(app: typer.Typer) -> Any:
    """The click command of `app`, built once per process. Typer builds it at every call of
    the app, reading the type hints of every command (~0.15 s of a `dr` call); a process
    that imported the CLI and forks (the CLI walk's driver) builds it once, before."""
    return typer.main.get_command(app)


def run_app(app: typer.Typer) -> None:
    """Run `app` (typer, not standalone) and map what it raises to one paragraph + exit."""
    try:
        code = click_command(app)(standalone_mode=False)
        if isinstance(code, int) and code:  # click returns Exit codes without standalone
            sys.exit(code)
    except Exit as exc:
        sys.exit(exc.code)
    except ConfigError as exc:
        if exc.issues and all(i.file == COMMAND_LINE or i.file.startswith("--")
                              for i in exc.issues):
            # options a model refused (e.g. `--max-rto-s -1`): name the options, not a file
            fail("; ".join(_option_issue(i) for i in exc.issues), EXIT_USAGE)
        if len(exc.issues) == 1 and not exc.more:  # one problem: one line
            _err.print(f"[red]invalid file:[/] {escape(str(exc.issues[0]))}", highlight=False,
                       soft_wrap=True)
            sys.exit(exc.exit_code)
        _err.print("[red]invalid file:[/]")
        for issue in exc.issues:
            _err.print(f"  {issue}", markup=False, highlight=False, soft_wrap=True)
        if exc.more:
            _err.print(f"  ... and {exc.more} more issue(s)", highlight=False)
        sys.exit(exc.exit_code)
    except CrossdcError as exc:
        _err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except ValidationError as exc:  # options that build a model (e.g. a flow) and fail it
        fail(_validation_line(exc), 2)
    except (typer.Abort, KeyboardInterrupt):
        _err.print("aborted")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:  # a file or port the system refused: the user can fix it
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        fail(f"{exc.strerror or exc}{where}", 1)
    except Exception as exc:
        if _is_click_exception(exc):
            sys.exit(_show_click(exc))
        raise


def _is_click_exception(exc: BaseException) -> bool:
    """Usage errors (unknown option, bad value) are click exceptions; typer vendors click or
    depends on it depending on its version (and a user's install may have no `click` at
    all), so they are recognised by their interface rather than by importing click."""
    return callable(getattr(exc, "format_message", None)) and \
        isinstance(getattr(exc, "exit_code", None), int)


def _show_click(exc: Exception) -> int:
    """One line, `error: <what> (see 'dr x --help')`, instead of click's usage block; the
    help a group prints when called bare stays as it is. Returns the exit code."""
    code = int(getattr(exc, "exit_code", 2)) or 2
    if type(exc).__name__ == "NoArgsIsHelpError":
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        return code
    message = str(exc.format_message()).strip()  # type: ignore[attr-defined]
    message = message.replace(": Value error, ", ": ")  # pydantic's prefix: noise here
    command_path = getattr(getattr(exc, "ctx", None), "command_path", None)
    hint = f" (see '{command_path} --help')" if command_path else ""
    fail_line(f"{message}{hint}")
    return code
