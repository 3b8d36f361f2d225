"""One error handler: core's typed errors become one red line on stderr and their exit code.

Exit codes: 2 bad input (a config that runs out of device memory too), 3 a diverged run (non-finite
loss), 4 a failed write (disk full, permissions, a storage quota), 130 interrupted. XLA's
out-of-device-memory error is not a DsvError when raised: `core.errors.device_memory_error` reads it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import typer

DEBUG = {"on": False}


def print_error(message: str) -> None:
    """One red line on stderr, "error: <message>"."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}")


def fail(message: str, code: int = 2) -> None:
    """Print one red line on stderr and exit with `code`."""
    print_error(message)
    raise typer.Exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command body: DsvError or a device out-of-memory -> one line, its exit_code (a traceback
    only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from core.errors import DsvError, device_memory_error

        try:
            return fn(*args, **kwargs)
        except DsvError as e:
            if DEBUG["on"]:
                raise
            fail(str(e), e.exit_code)
        except Exception as e:
            error = device_memory_error(e)
            if error is None or DEBUG["on"]:
                raise
            fail(str(error), error.exit_code)
        except KeyboardInterrupt:
            if DEBUG["on"]:
                raise
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130)

    return wrapper
