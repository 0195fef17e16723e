"""What every `opsadv` command shares (opsadv/cli.py, opsadv/convert/cli.py): the argument parser whose usage
errors are one line, and the one-line error report (the traceback only at --log-level debug)."""
from __future__ import annotations

import argparse
import logging
import sys

from .core.errors import BackendUnavailableError, NoKernelError, OpsadvError, ValidationError

log = logging.getLogger("opsadv")


class Parser(argparse.ArgumentParser):
    """Usage errors as one line with a hint (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _hint(e: BaseException, command: str | None) -> str:
    if isinstance(e, BackendUnavailableError):
        return "`opsadv info` lists every backend with its probe result"
    if isinstance(e, NoKernelError):
        return "`opsadv info --impls` lists the kernels and what they support; opsadv.explain() shows why each refused"
    if isinstance(e, ValidationError):
        return "--log-level debug shows the traceback"
    return f"see `opsadv {command} --help`" if command else "see `opsadv --help`"


def one_line(e: BaseException) -> str:
    """An error message as one line (multi-line ones: their lines joined)."""
    lines = [ln.strip().lstrip("- ").strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] + ("" if len(lines) == 1 else " " + "; ".join(lines[1:]))


def format_error(command: str | None, e: BaseException) -> str:
    """`opsadv CMD: error: MESSAGE (hint: ...)`: the one line every CLI error is."""
    msg = one_line(e)
    if command and msg.startswith(f"opsadv.{command}: "):     # the prefix says it already
        msg = msg[len(f"opsadv.{command}: "):]
    if not isinstance(e, OpsadvError):
        msg = f"{type(e).__name__}: {msg}"
        hint = "rerun with --log-level debug for the traceback"
    else:
        hint = _hint(e, command)
    return f"opsadv{' ' + command if command else ''}: error: {msg} (hint: {hint})"


def report_error(command: str | None, e: BaseException) -> None:
    log.debug("traceback of the error below", exc_info=e)     # shown with --log-level debug only
    print(format_error(command, e), file=sys.stderr, flush=True)
