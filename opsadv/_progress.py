"""Progress bars of the long commands (conformance, bench, optimize, tune): tqdm on stderr, with an ETA where
the total is known.  Mode "auto" (default; $OPSADV_PROGRESS overrides it) shows them only when stderr is a
terminal, so logs and pipes stay clean; "on" forces them, "off" hides them."""
from __future__ import annotations

import os
import sys

MODES = ("auto", "on", "off")
_open: list = []       # bars now on screen: lines printed meanwhile go through tqdm.write


def enabled(mode: str | None = None) -> bool:
    mode = (mode or os.environ.get("OPSADV_PROGRESS") or "auto").lower()
    if mode in ("on", "1", "true", "yes"):
        return True
    if mode in ("off", "0", "false", "no"):
        return False
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class _Bar:
    """A tqdm bar (or nothing, when disabled) that registers itself so say() does not tear it."""

    def __init__(self, total, desc: str, unit: str, mode: str | None):
        self.tq = None
        if enabled(mode):
            from tqdm import tqdm
            self.tq = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True)
            _open.append(self)

    def update(self, n: int = 1) -> None:
        if self.tq is not None:
            self.tq.update(n)

    def set_description(self, text: str) -> None:
        if self.tq is not None:
            self.tq.set_description(text)

    def set_postfix(self, text: str) -> None:
        if self.tq is not None:
            self.tq.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        if self.tq is not None:
            self.tq.close()
            _open.remove(self)
            self.tq = None

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int | None, desc: str, unit: str = "it", mode: str | None = None) -> _Bar:
    return _Bar(total, desc, unit, mode)


def say(msg: str, file=None) -> None:
    """print(msg) to stdout (or `file`), above any open bar."""
    file = file or sys.stdout
    if _open:
        from tqdm import tqdm
        tqdm.write(msg, file=file)
        file.flush()
    else:
        print(msg, file=file, flush=True)
