"""The tuning caches on disk (issue 37 item 5, issue 36's tuning-cache item): a cache file of the wrong shape never
breaks an op or `opsadv info --tuning`; a file that does not parse is moved aside, never overwritten; bad entries are
dropped and the rest used; concurrent processes keep every entry (file lock + merge); entries of another opsadv
version are ignored; the file is capped (oldest evicted) and an oversized one is not parsed; the directory follows
$XDG_CACHE_HOME unless $OPSADV_CACHE_DIR is set."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import warnings

import pytest
import torch

import opsadv
from opsadv.core import cachefile, dispatch, tuning
from opsadv.core.env import current_env
from opsadv.core.kernel import CallSpec

HERE = tuning._device_key(current_env())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    dispatch.clear_cache()
    yield tmp_path
    tuning.reload()
    dispatch.clear_cache()


def _file(sections: dict, t: float = 1.0) -> str:
    return json.dumps({"schema": cachefile.SCHEMA, "sections": {
        s: {k: {"value": v, "time": t} for k, v in entries.items()} for s, entries in sections.items()}})


def _spec(i: int = 0) -> CallSpec:
    return CallSpec("x", "cuda", torch.float16, frozenset(), (16 + i,))


def _measured(winner: str) -> tuning.Measured:
    return tuning.Measured(winner, {winner: 1.0, "b": 2.0})


def _rms_norm_call():
    """A call with two accepted impls (the interpreter's Triton norm and the reference): dispatch reads the cache."""
    x, w = torch.randn(5, 64), torch.randn(64)
    exp = opsadv.explain("rms_norm", x, w)
    assert sum(c.accepted for c in exp.candidates) >= 2, str(exp)
    out = opsadv.ops.rms_norm(x, w)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _asides(d, name="tuning.json"):
    return sorted(p for p in d.iterdir() if p.name.startswith(name + ".corrupt-"))


@pytest.mark.parametrize("content", ["[]", "{}{", '"text"', "\x00\x01\xff binary", "[" * 100_000 + "]" * 100_000,
                                     '{"schema": 2, "sections": []}', '{"schema": "2"}'],
                         ids=["list", "truncated", "string", "binary", "deep", "sections-list", "schema-str"])
def test_bad_tuning_file_breaks_no_op_and_is_moved_aside(cache, content):
    (cache / "tuning.json").write_bytes(content.encode("latin-1"))
    with pytest.warns(RuntimeWarning, match="not a valid cache.*moved aside"):
        _rms_norm_call()
    (aside,) = _asides(cache)
    assert aside.read_bytes() == content.encode("latin-1")          # kept byte for byte
    tuning.store(_spec(), current_env(), _measured("a"))
    data = json.loads((cache / "tuning.json").read_text())          # a fresh, valid file
    assert data["schema"] == cachefile.SCHEMA and list(data["sections"][HERE]) == [tuning.spec_key(_spec())]
    assert _asides(cache) == [aside]


def test_truncated_file_is_not_overwritten_by_a_writer(cache):
    """A writer that finds the file unreadable moves it aside first: other devices' sections stay recoverable."""
    good = _file({"Other GPU|torch 1|triton 1|opsadv 0.1.0": {"k": {"winner": "w", "times_ms": {}}}})
    (cache / "tuning.json").write_text(good[:-7])
    with pytest.warns(RuntimeWarning, match="moved aside"):
        tuning.store(_spec(), current_env(), _measured("a"))
    (aside,) = _asides(cache)
    assert aside.read_text() == good[:-7]


def test_info_tuning_survives_bad_caches(cache):
    (cache / "tuning.json").write_text("[]")
    (cache / "kernel_configs.json").write_text("[" * 50_000)
    out = subprocess.run([sys.executable, "-m", "opsadv", "info", "--tuning"], capture_output=True, text=True,
                         env={**os.environ, "OPSADV_CACHE_DIR": str(cache)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nothing measured for this device yet" in out.stdout
    assert "not a valid cache" in out.stderr


def test_bad_entries_are_dropped_and_the_rest_used(cache):
    sections = {HERE: {tuning.spec_key(_spec(0)): {"winner": "a", "times_ms": {"a": 1.0}},
                       tuning.spec_key(_spec(1)): ["not", "an", "entry"],
                       tuning.spec_key(_spec(2)): {"times_ms": {}},                       # no winner
                       tuning.spec_key(_spec(3)): {"winner": "a", "times_ms": {"a": "fast"}},
                       tuning.spec_key(_spec(4)): {"winner": "a", "shapes": [[1, "x"]]}}}
    raw = json.loads(_file(sections))
    raw["sections"][HERE]["no time"] = {"value": {"winner": "a"}}
    raw["sections"]["a list section"] = []
    (cache / "tuning.json").write_text(json.dumps(raw))
    with pytest.warns(RuntimeWarning, match="ignored 6 malformed entries"):
        assert tuning.lookup(_spec(0), ["a", "b"], current_env()).winner == "a"
    for i in (1, 2, 3, 4):
        assert tuning.lookup(_spec(i), ["a", "b"], current_env()) is None
    assert not _asides(cache)                                        # the file parsed: not moved


def test_kernel_config_cache_of_the_wrong_shape(cache, monkeypatch):
    pytest.importorskip("triton")
    from opsadv.backends.triton_common import utils as U
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())
    section = U._device_section()
    deep = {"a": {"b": {"c": {"d": [1]}}}}                  # deeper than any config
    (cache / "kernel_configs.json").write_text(_file({section: {"t|('k', 1)": deep, "t|('k', 2)": {"BLOCK_M": 64}}}))
    configs = [{"BLOCK_M": 32}, {"BLOCK_M": 64}]
    with pytest.warns(RuntimeWarning, match="ignored 1 malformed entry"):
        assert U.ConfigTuner("t").pick(("k", 2), configs, lambda c: 1 / 0, autotune=True) == {"BLOCK_M": 64}
    (cache / "kernel_configs.json").write_text("[]")
    monkeypatch.setattr(U, "_CONFIGS", None)
    with pytest.warns(RuntimeWarning, match="moved aside"):
        best = U.ConfigTuner("t").pick(("k", 1), configs, lambda c: {32: 2.0, 64: 1.0}[c["BLOCK_M"]], autotune=True)
    assert best == {"BLOCK_M": 64}
    assert len(_asides(cache, "kernel_configs.json")) == 1


def _writer(n: int, barrier, count: int) -> None:
    tuning.reload()
    env = current_env()
    barrier.wait()
    for i in range(count):
        tuning.store(_spec(1000 * n + i), env, _measured(f"w{n}"))


def test_concurrent_processes_keep_every_entry(cache):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_writer, args=(n, barrier, 50)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    data = json.loads((cache / "tuning.json").read_text())
    entries = data["sections"][HERE]
    assert len(entries) == 200
    assert {e["value"]["winner"] for e in entries.values()} == {"w0", "w1", "w2", "w3"}
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]


def test_a_write_merges_what_another_process_stored(cache):
    env = current_env()
    tuning.store(_spec(0), env, _measured("mine"))
    other = cachefile.JsonCache("tuning.json")                       # "another process"
    other.put(HERE, tuning.spec_key(_spec(1)), {"winner": "theirs", "times_ms": {}})
    tuning.store(_spec(2), env, _measured("mine"))
    assert tuning.lookup(_spec(1), ["theirs", "x"], env).winner == "theirs"
    assert len(json.loads((cache / "tuning.json").read_text())["sections"][HERE]) == 3


def test_other_opsadv_versions_are_ignored_and_kept(cache):
    env = current_env()
    old = HERE.replace(f"opsadv {opsadv.__version__}", "opsadv 0.0.1")
    assert old != HERE and HERE.endswith(f"|opsadv {opsadv.__version__}")
    key = tuning.spec_key(_spec())
    legacy_section = HERE.rsplit("|opsadv", 1)[0]                   # a pre-schema file's section name
    (cache / "tuning.json").write_text(json.dumps({
        legacy_section: {key: {"winner": "legacy"}},
        "schema": cachefile.SCHEMA, "sections": json.loads(_file({old: {key: {"winner": "a", "times_ms": {}}}}))[
            "sections"]}))
    assert tuning.lookup(_spec(), ["a", "legacy"], env) is None
    tuning.store(_spec(), env, _measured("b"))
    data = json.loads((cache / "tuning.json").read_text())
    assert data["sections"][old][key]["value"]["winner"] == "a"     # another version's entry stays on disk
    assert data[legacy_section] == {key: {"winner": "legacy"}}      # and an older opsadv's top-level section
    assert data["sections"][HERE][key]["value"]["winner"] == "b"


def test_newer_schema_is_neither_used_nor_overwritten(cache):
    text = json.dumps({"schema": cachefile.SCHEMA + 1, "sections": {HERE: {tuning.spec_key(_spec()): "?"}}})
    (cache / "tuning.json").write_text(text)
    assert tuning.lookup(_spec(), ["a", "b"], current_env()) is None
    tuning.store(_spec(), current_env(), _measured("a"))
    assert (cache / "tuning.json").read_text() == text
    assert tuning.lookup(_spec(), ["a", "b"], current_env()).winner == "a"      # kept for this process


def test_size_cap_evicts_oldest(cache, monkeypatch):
    monkeypatch.setattr(cachefile, "MAX_ENTRIES", 10)
    other = HERE.replace("|opsadv", "|other|opsadv")
    (cache / "tuning.json").write_text(_file({other: {f"old{i}": {"winner": "o"} for i in range(5)}}, t=5.0))
    env = current_env()
    for i in range(12):
        tuning.store(_spec(i), env, _measured("a"))
    data = json.loads((cache / "tuning.json").read_text())["sections"]
    assert other not in data                                         # the oldest went first
    assert sorted(data[HERE]) == sorted(tuning.spec_key(_spec(i)) for i in range(2, 12))


def test_oversized_file_is_not_parsed(cache, monkeypatch):
    monkeypatch.setattr(cachefile, "MAX_BYTES", 1 << 20)
    big = _file({HERE: {f"k{i}": {"winner": "a", "times_ms": {"a": 1.0}} for i in range(30_000)}})
    assert len(big) > 1 << 20
    (cache / "tuning.json").write_text(big)
    parsed = []
    real = json.loads
    monkeypatch.setattr(cachefile.json, "loads", lambda s, *a, **k: parsed.append(len(s)) or real(s, *a, **k))
    with pytest.warns(RuntimeWarning, match="MiB.*moved aside"):
        assert tuning.lookup(_spec(), ["a", "b"], current_env()) is None
    assert not [n for n in parsed if n > 1 << 20]
    assert len(_asides(cache)) == 1


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("OPSADV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cachefile.cache_dir() == tmp_path / "xdg" / "opsadv" == tuning.cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")            # the XDG spec: relative paths are ignored
    assert cachefile.cache_dir() == cachefile.Path.home() / ".cache" / "opsadv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cachefile.cache_dir() == cachefile.Path.home() / ".cache" / "opsadv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path / "own"))   # opsadv's own variable wins
    assert cachefile.cache_dir() == tmp_path / "own"


def test_unwritable_cache_keeps_results_in_memory(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(blocker / "sub"))   # a directory under a file: never creatable
    tuning.reload()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tuning.store(_spec(), current_env(), _measured("a"))
        assert tuning.lookup(_spec(), ["a", "b"], current_env()).winner == "a"
    finally:
        tuning.reload()


def test_unreadable_cache_file_is_left_alone(cache):
    (cache / "tuning.json").mkdir()                                  # exists, cannot be read as a file
    (cache / "tuning.json" / "keep").write_text("x")
    _rms_norm_call()
    tuning.store(_spec(), current_env(), _measured("a"))
    assert (cache / "tuning.json" / "keep").read_text() == "x" and not _asides(cache)
    assert tuning.lookup(_spec(), ["a", "b"], current_env()).winner == "a"


def test_deep_value_inside_a_valid_file(cache):
    """Nesting that still parses (900 deep) inside an entry: dropped as malformed, info --tuning still prints."""
    deep = "[" * 900 + "]" * 900
    for name in ("tuning.json", "kernel_configs.json"):
        (cache / name).write_text('{"schema": 2, "sections": {"%s": {"k": {"time": 1, "value": %s}}}}' % (HERE, deep))
    with pytest.warns(RuntimeWarning, match="malformed"):
        text = tuning.report(current_env())
    assert text.count("nothing measured for this device yet") == 2
