"""The tuning caches on disk: JSON files in cache_dir(), validated when read, locked and merged when written.

File shape (schema 2): {"schema": 2, "sections": {section: {key: {"value": <JSON>, "time": <unix seconds>}}}}.
A section names the device and the library versions, opsadv's included, so entries written by another device
or another opsadv are kept on disk but never used here.

- Read once per process (and again when the cache directory changes), bounded: a file over MAX_BYTES was not
  written by opsadv and is moved aside unread.
- A file that is not JSON, or JSON of another shape (`[]`, nesting too deep to parse), is moved aside as
  `<name>.corrupt-<time>` with a warning and the cache starts empty: it is never overwritten.
- An entry of the wrong shape is dropped with one warning per file; the rest are used.
- A write takes a file lock (filelock) across processes, re-reads the file, merges this process's new entries
  into it, evicts the oldest beyond MAX_ENTRIES and replaces the file atomically (temp file + os.replace):
  concurrent processes keep each other's entries and a reader never sees a torn file.
- Top-level keys it does not know (an older opsadv's sections, written before the schema field) are kept as
  they are; a file of a newer schema is read as empty and never written."""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import filelock

log = logging.getLogger("opsadv.tuning")

SCHEMA = 2
MAX_ENTRIES = 4096          # per file, over every section; the oldest beyond it are evicted on write
MAX_BYTES = 8 << 20         # opsadv writes at most ~2 MiB (MAX_ENTRIES small entries): a larger file is not its own
LOCK_TIMEOUT_S = 10.0       # a write that cannot take the lock in this time is skipped (the result stays in memory)


def cache_dir() -> Path:
    """$OPSADV_CACHE_DIR, else $XDG_CACHE_HOME/opsadv (an absolute path, as the XDG spec requires), else
    ~/.cache/opsadv."""
    own = os.environ.get("OPSADV_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "opsadv"
    return Path.home() / ".cache" / "opsadv"


Validator = Callable[[Any], "str | None"]      # value -> why it is malformed (None: fine)


def json_depth_ok(value: Any, depth: int = 4) -> bool:
    """value is JSON scalars in lists / objects nested at most `depth` deep (a kernel config)."""
    if isinstance(value, (str, bool, int, type(None))):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth <= 0:
        return False
    if isinstance(value, list):
        return all(json_depth_ok(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return all(json_depth_ok(v, depth - 1) for v in value.values())
    return False


class _Corrupt(Exception):
    pass


class _Unreadable(OSError):
    pass


class JsonCache:
    """One cache file: `section(name)` -> {key: value} (validated), `put(section, key, value)` (persisted)."""

    def __init__(self, name: str, validate: Validator | None = None):
        self.name = name
        self.validate = validate
        self.lock = threading.RLock()
        self._sections: dict[str, dict[str, dict]] | None = None   # section -> key -> {"value", "time"}
        self._read_from: Path | None = None
        self._pending: dict[tuple[str, str], dict] = {}            # written here, not yet on disk
        self._read_only = False                                     # a newer schema's file: never written
        self._warned_write = False
        _INSTANCES.add(self)

    def path(self) -> Path:
        return cache_dir() / self.name

    # -- reading ---------------------------------------------------------------------------
    def _parse(self, path: Path) -> tuple[dict | None, dict, list[str]]:
        """(sections or None for a newer schema, other top-level keys, dropped-entry reasons) of the file at path;
        _Corrupt when it is not a cache file.  A missing file is an empty cache."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return {}, {}, []
        except OSError as e:        # a path through a file, no permission: read as empty, never written over
            raise _Unreadable(f"{type(e).__name__}: {e}") from None
        if size > MAX_BYTES:
            raise _Corrupt(f"{size / 2**20:.1f} MiB, over the {MAX_BYTES >> 20} MiB opsadv ever writes")
        try:
            top = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            return {}, {}, []
        except OSError as e:
            raise _Unreadable(f"{type(e).__name__}: {e}") from None
        except (ValueError, RecursionError) as e:       # not JSON / not UTF-8 / nested too deep to parse
            raise _Corrupt(f"not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
        if not isinstance(top, dict):
            raise _Corrupt(f"a JSON {type(top).__name__}, not an object")
        schema = top.get("schema")
        if schema is None:                              # written before the schema field: kept, never read
            return {}, top, []
        if isinstance(schema, bool) or not isinstance(schema, int):
            raise _Corrupt(f"schema {schema!r} is not an integer")
        if schema > SCHEMA:
            return None, {}, []
        extra = {k: v for k, v in top.items() if k not in ("schema", "sections")}
        if schema < SCHEMA:
            return {}, extra, []
        raw = top.get("sections")
        if not isinstance(raw, dict):
            raise _Corrupt(f"'sections' is a {type(raw).__name__}, not an object")
        sections: dict[str, dict[str, dict]] = {}
        dropped: list[str] = []
        for sec, entries in raw.items():
            if not isinstance(entries, dict):
                dropped.append(f"section {sec[:80]!r} is a {type(entries).__name__}")
                continue
            good = {}
            for key, entry in entries.items():
                why = self._check(entry)
                if why:
                    dropped.append(f"{key[:80]!r}: {why}")
                else:
                    good[key] = {"value": entry["value"], "time": float(entry["time"])}
            sections[sec] = good
        return sections, extra, dropped

    def _check(self, entry: Any) -> str | None:
        if not isinstance(entry, dict) or "value" not in entry:
            return "not an object with a 'value'"
        t = entry.get("time")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            return "no numeric 'time'"
        return self.validate(entry["value"]) if self.validate is not None else None

    def _move_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            return
        except OSError as e:
            warnings.warn(f"opsadv: tuning cache {path} is not a valid cache ({why}) and could not be moved aside "
                          f"({e}); it is ignored", RuntimeWarning, stacklevel=4)
            self._read_only = True
            return
        warnings.warn(f"opsadv: tuning cache {path} is not a valid cache ({why}); moved aside to {aside.name}, "
                      "starting empty", RuntimeWarning, stacklevel=4)

    def _read(self, path: Path) -> tuple[dict | None, dict]:
        """Parse path; a corrupt file is moved aside under the lock (unless a writer replaced it meanwhile)."""
        try:
            sections, extra, dropped = self._parse(path)
        except _Unreadable as e:
            log.debug("tuning cache %s not readable (%s): empty", path, e)
            return {}, {}
        except _Corrupt as first:
            try:
                with self._file_lock(path):
                    try:
                        sections, extra, dropped = self._parse(path)    # a writer may have replaced it meanwhile
                    except _Unreadable:
                        return {}, {}
                    except _Corrupt as e:
                        self._move_aside(path, str(e))
                        sections, extra, dropped = {}, {}, []
            except (OSError, filelock.Timeout):
                warnings.warn(f"opsadv: tuning cache {path} is not a valid cache ({first}); ignored",
                              RuntimeWarning, stacklevel=3)
                return {}, {}
        if dropped:
            warnings.warn(f"opsadv: tuning cache {path}: ignored {len(dropped)} malformed "
                          f"entr{'y' if len(dropped) == 1 else 'ies'} (first: {dropped[0]}); the rest are used",
                          RuntimeWarning, stacklevel=3)
        return sections, extra

    def _loaded(self) -> dict[str, dict[str, dict]]:
        path = self.path()
        if self._sections is None or self._read_from != path:
            with self.lock:
                if self._sections is None or self._read_from != path:
                    self._read_only = False
                    sections, _ = self._read(path)
                    if sections is None:
                        self._read_only = True
                        log.warning("tuning cache %s was written by a newer opsadv (schema above %d): not used here",
                                    path, SCHEMA)
                    self._sections = sections or {}
                    self._read_from = path
                    self._pending.clear()
                    log.debug("tuning cache %s read: %d sections", path, len(self._sections))
        return self._sections

    def section(self, section: str) -> dict[str, Any]:
        """{key: value} of one section (empty when nothing is stored)."""
        return {k: e["value"] for k, e in self._loaded().get(section, {}).items()}

    def get(self, section: str, key: str) -> Any:
        e = self._loaded().get(section, {}).get(key)
        return None if e is None else e["value"]

    def sections(self) -> dict[str, dict[str, Any]]:
        """Every valid section of the file, this opsadv's and others'."""
        return {s: {k: e["value"] for k, e in entries.items()} for s, entries in self._loaded().items()}

    def reset(self) -> None:
        """Forget what was read (the next access reads the file again)."""
        with self.lock:
            self._sections = None
            self._read_from = None
            self._pending.clear()

    # -- writing ---------------------------------------------------------------------------
    def _file_lock(self, path: Path) -> filelock.FileLock:
        return filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)

    def put(self, section: str, key: str, value: Any) -> None:
        """Store value (JSON) under section / key, in memory and on disk (merged into what other processes
        wrote).  A cache that cannot be written (read-only directory, lock timeout) keeps it for this process."""
        value = json.loads(json.dumps(value))          # what a later process reads back (tuples become lists)
        with self.lock:
            entry = {"value": value, "time": time.time()}
            self._loaded().setdefault(section, {})[key] = entry
            self._pending[(section, key)] = entry
            self._flush()

    def _flush(self) -> None:
        path = self.path()
        if self._read_only:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._file_lock(path):
                try:
                    disk, extra, dropped = self._parse(path)
                except _Corrupt as e:
                    self._move_aside(path, str(e))
                    disk, extra, dropped = {}, {}, []
                if disk is None:                # a newer opsadv's file appeared: leave it alone
                    self._read_only = True
                    return
                for (sec, key), entry in self._pending.items():
                    old = disk.setdefault(sec, {}).get(key)
                    if old is None or old["time"] <= entry["time"]:
                        disk[sec][key] = entry
                _evict(disk, MAX_ENTRIES)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
                try:
                    # compact: json's C encoder (an indented dump is pure Python, ~5x slower at the cap)
                    text = json.dumps({**extra, "schema": SCHEMA, "sections": disk}, sort_keys=True,
                                      separators=(",", ":"))
                    with os.fdopen(fd, "w") as f:
                        f.write(text)
                    os.replace(tmp, path)
                except BaseException:
                    os.unlink(tmp)
                    raise
            self._sections = disk       # what the other processes stored is visible here too from now on
            self._pending.clear()
        except (OSError, filelock.Timeout) as e:
            if not self._warned_write:
                self._warned_write = True
                log.warning("tuning cache %s not written (%s: %s): results are kept for this process only",
                            path, type(e).__name__, e)


_INSTANCES: "weakref.WeakSet[JsonCache]" = weakref.WeakSet()


def _after_fork() -> None:
    for c in list(_INSTANCES):      # a lock held by another thread at fork would never be released in the child
        c.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _evict(sections: dict[str, dict[str, dict]], cap: int) -> None:
    """Drop the oldest entries (every section) beyond cap, and sections left empty."""
    total = sum(len(v) for v in sections.values())
    if total > cap:
        by_age = sorted(((e["time"], s, k) for s, entries in sections.items() for k, e in entries.items()))
        for _, s, k in by_age[:total - cap]:
            del sections[s][k]
    for s in [s for s, v in sections.items() if not v]:
        del sections[s]
