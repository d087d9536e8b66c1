"""How a `dr` command ends: every error a user can cause becomes one readable paragraph and
an exit code, never a traceback.

0 ok; 1 a crossdc error (or the system refused: a file, a port); 2 bad input (options, files
a user wrote); 3 and up: a command's own verdicts (e.g. a reconciliation threshold); 130
interrupted.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from crossdc.errors import ConfigError, CrossdcError

__all__ = ["Exit", "fail", "run_app"]

_err = Console(stderr=True)


class Exit(Exception):
    """End the command with `code` after its output was printed."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def fail(message: str, code: int = 2) -> NoReturn:
    """One red line and exit `code` (2: bad input)."""
    _err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def _validation_line(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or exc.title
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def run_app(app: typer.Typer) -> None:
    """Run `app` (typer, not standalone) and map what it raises to one paragraph + exit."""
    try:
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:  # click returns Exit codes without standalone
            sys.exit(code)
    except Exit as exc:
        sys.exit(exc.code)
    except ConfigError as exc:
        _err.print("[red]invalid file:[/]")
        for issue in exc.issues:
            _err.print(f"  {issue}", markup=False, highlight=False, soft_wrap=True)
        if exc.more:
            _err.print(f"  ... and {exc.more} more issue(s)", highlight=False)
        sys.exit(2)
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
        # Usage errors (unknown option, bad value) are click exceptions; typer vendors or
        # depends on click depending on its version, so recognise them by their interface
        # rather than importing click.
        show, exit_code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
        if callable(show) and isinstance(exit_code, int):
            show()
            sys.exit(exit_code or 2)
        raise
