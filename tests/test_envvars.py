"""Boolean environment variables (one parser: opsadv.core.envvars), TRITON_INTERPRET read as Triton reads
it, OPSADV_BACKEND normalized, and use_backend's policy flags bool-only (issue 37 item 6)."""
import importlib.metadata

import pytest
import torch

import opsadv
from opsadv.core import dispatch, envvars, policy
from opsadv.core.env import current_env, detect
from opsadv.errors import BackendUnavailableError, EnvVarError, InvalidArgumentError
from opsadv.registry import manager


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("true", True), ("FALSE", False), ("On", True),
                                        ("off", False), ("yes", True), ("No", False), (" 1 ", True), ("\toff\n", False),
                                        ("", False), ("  ", False), (None, False)])
def test_parse_bool_accepted(value, want):
    assert envvars.parse_bool("OPSADV_X", value) is want


@pytest.mark.parametrize("value", ["2", "maybe", "y", "enabled", "-1", "1.0"])
def test_parse_bool_rejects_others(value):
    with pytest.raises(EnvVarError) as e:
        envvars.parse_bool("OPSADV_X", value)
    msg = str(e.value)
    assert "OPSADV_X" in msg and repr(value) in msg and "true/false" in msg and "on/off" in msg and "yes/no" in msg
    assert isinstance(e.value, ValueError)


def test_parse_bool_default():
    assert envvars.env_bool("OPSADV_UNSET_X", default=True, environ={}) is True
    assert envvars.env_bool("OPSADV_UNSET_X", default=True, environ={"OPSADV_UNSET_X": "off"}) is False


@pytest.mark.parametrize("value", ["1", "0", "true", "false", "TRUE", "off", "on", "ON", "yes", "no", "y", "Y", "n",
                                   "2", " 1", "1 ", "", "garbage", "Yes"])
def test_triton_interpret_matches_triton(monkeypatch, value):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert envvars.triton_interpret() is bool(knobs.runtime.interpret), value
    assert detect(environ={"TRITON_INTERPRET": value}).triton_interpret is bool(knobs.runtime.interpret), value


@pytest.mark.parametrize("value", ["false", "off", "2", "0", "no"])
def test_triton_interpret_off_values(value):
    assert detect(environ={"TRITON_INTERPRET": value}).triton_interpret is False


def test_triton_interpret_unset():
    assert detect(environ={}).triton_interpret is False
    assert detect(environ={"TRITON_INTERPRET": "1"}).triton_interpret is True


def _dispatch_once(n):
    dispatch.clear_cache()                    # the memo is per policy content: empty it so this call resolves (and announces)
    with opsadv.use_backend("reference"):
        opsadv.ops.rms_norm(torch.randn(2, n), torch.randn(n))


def test_log_dispatch(monkeypatch, capsys):
    monkeypatch.setenv("OPSADV_LOG_DISPATCH", "false")
    _dispatch_once(24)
    assert "opsadv: rms_norm" not in capsys.readouterr().err
    monkeypatch.setenv("OPSADV_LOG_DISPATCH", " TRUE ")
    _dispatch_once(24)
    assert "opsadv: rms_norm" in capsys.readouterr().err
    monkeypatch.setenv("OPSADV_LOG_DISPATCH", "maybe")
    with pytest.raises(EnvVarError, match="OPSADV_LOG_DISPATCH"):
        _dispatch_once(24)


@pytest.mark.parametrize("value,want", [("off", False), ("false", False), ("ON", True), ("yes", True)])
def test_strict_plugins(monkeypatch, value, want):
    monkeypatch.setenv("OPSADV_STRICT_PLUGINS", value)
    assert manager.Registry(current_env()).strict is want


@pytest.mark.parametrize("value,autoload", [("off", True), ("false", True), ("0", True), ("on", False), ("1", False)])
def test_disable_plugin_autoload(monkeypatch, value, autoload):
    calls = []
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: calls.append(kw) or [])
    monkeypatch.setenv("OPSADV_DISABLE_PLUGIN_AUTOLOAD", value)
    manager.Registry(current_env()).load_all()
    assert bool(calls) is autoload


def test_plugin_env_flag_rejects_garbage(monkeypatch):
    monkeypatch.setenv("OPSADV_STRICT_PLUGINS", "perhaps")
    with pytest.raises(EnvVarError, match="OPSADV_STRICT_PLUGINS"):
        manager.Registry(current_env())


@pytest.mark.parametrize("value,want", [(" reference", "reference"), ("REFERENCE", "reference"),
                                        (" Reference \n", "reference"), ("", "auto"), ("  ", "auto")])
def test_opsadv_backend_normalized(monkeypatch, value, want):
    monkeypatch.setenv("OPSADV_BACKEND", value)
    assert policy._default_policy().backend == want


def test_opsadv_backend_normalized_dispatches(monkeypatch):
    monkeypatch.setenv("OPSADV_BACKEND", " REFERENCE")
    prev = policy._set_global(policy._default_policy())
    try:
        opsadv.ops.rms_norm(torch.randn(2, 16), torch.randn(16))
        assert opsadv.explain("rms_norm", torch.randn(2, 16), torch.randn(16)).chosen == "reference.rms_norm"
    finally:
        policy._set_global(prev)


def test_opsadv_backend_unknown_lists_registered(monkeypatch):
    monkeypatch.setenv("OPSADV_BACKEND", "nosuch")
    prev = policy._set_global(policy._default_policy())
    try:
        with pytest.raises(BackendUnavailableError) as e:
            opsadv.ops.rms_norm(torch.randn(2, 16), torch.randn(16))
    finally:
        policy._set_global(prev)
    assert "nosuch" in str(e.value) and "registered backends" in str(e.value) and "'reference'" in str(e.value)


@pytest.mark.parametrize("key", ["strict", "experimental", "deterministic", "autotune"])
@pytest.mark.parametrize("value", ["no", "false", "off", 2, 1, 0, None])
def test_policy_flags_bool_only(key, value):
    before = policy.current_policy()
    with pytest.raises(InvalidArgumentError) as e:
        opsadv.use_backend("auto", **{key: value})
    msg = str(e.value)
    assert "use_backend" in msg and key in msg and "bool" in msg and repr(value) in msg
    assert policy.current_policy() == before          # nothing was applied


@pytest.mark.parametrize("key", ["strict", "experimental", "deterministic", "autotune"])
def test_policy_flags_accept_bools(key):
    for v in (True, False):
        with opsadv.use_backend("reference", **{key: v}) as b:
            assert getattr(b.policy, key) is v
