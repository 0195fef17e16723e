"""Plugin isolation beyond exceptions (issue 37 item 4): a plugin that calls sys.exit at import or in a hook, or
changes process globals (torch's default dtype, grad mode, threads, the environment, warning filters) while it
loads, never ends the program; torch's globals and the user's environment variables are put back, what the plugin
added is kept (vendor stacks set their own at import) and every change is recorded and warned about."""
import sys
import types

import pytest
import torch

import opsadv
from opsadv.errors import PluginError
from opsadv.registry import BackendInfo, ProbeResult, hookimpl
from opsadv.registry.manager import Registry, side_effects


def _plugin(name, *, probe=None, register=None, activate=None):
    mod = types.ModuleType(name)

    @hookimpl
    def opsadv_backend_info():
        return BackendInfo(name=name, vendor="test", device_types=("cpu",), version="0")

    @hookimpl
    def opsadv_probe(env):
        if probe:
            probe()
        return ProbeResult(True, ("test",))

    @hookimpl
    def opsadv_register_kernels(registry, env):
        if register:
            register()

    mod.opsadv_backend_info, mod.opsadv_probe, mod.opsadv_register_kernels = (opsadv_backend_info, opsadv_probe,
                                                                              opsadv_register_kernels)
    if activate:
        @hookimpl
        def opsadv_activate(options, env):
            activate()
        mod.opsadv_activate = opsadv_activate
    return mod


def test_sys_exit_at_import_is_a_recorded_failure():
    reg = Registry()

    def loader():
        sys.exit(3)
    with pytest.warns(RuntimeWarning, match="skipping plugin"):
        reg._load("exits_at_import", "test", "0", loader)
    assert reg.failures and reg.failures[-1].stage == "import" and "SystemExit" in reg.failures[-1].error


def test_sys_exit_in_probe_is_a_recorded_failure():
    reg = Registry()
    with pytest.warns(RuntimeWarning, match="skipping plugin"):
        assert reg.register_plugin(_plugin("exits_in_probe", probe=lambda: sys.exit(4))) is None
    assert reg.failures[-1].stage == "probe" and "SystemExit" in reg.failures[-1].error
    assert "exits_in_probe" not in reg.backends


def test_sys_exit_in_a_later_hook_raises_plugin_error():
    reg = Registry()
    rec = reg.register_plugin(_plugin("exits_on_activate", activate=lambda: sys.exit(5)))
    with pytest.raises(PluginError, match="SystemExit"):
        rec.call("opsadv_activate", options={}, env=reg.env)


def test_changed_globals_are_restored_and_recorded(monkeypatch):
    dtype, grad, threads = torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()

    import os
    monkeypatch.setenv("OPSADV_TEST_USER_VAR", "user")
    monkeypatch.delenv("OPSADV_TEST_PLUGIN_VAR", raising=False)

    def meddle():
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        os.environ["OPSADV_TEST_USER_VAR"] = "plugin"          # the user's setting: put back
        os.environ["OPSADV_TEST_PLUGIN_VAR"] = "1"             # its own addition: kept, reported
    reg = Registry()
    with pytest.warns(RuntimeWarning, match="changed default dtype; grad mode; environment"):
        rec = reg.register_plugin(_plugin("meddles", probe=meddle))
    assert rec is not None and rec.available                         # it still loads
    assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()) == (dtype, grad, threads)
    assert os.environ["OPSADV_TEST_USER_VAR"] == "user"
    monkeypatch.delenv("OPSADV_TEST_PLUGIN_VAR")
    (note,) = [s for s in side_effects() if s.startswith("meddles: registration changed")]
    assert "environment (restored)" in note and "added OPSADV_TEST_PLUGIN_VAR (kept)" in note


def test_well_behaved_plugins_change_nothing():
    n = len(side_effects())
    opsadv.registry.reset_registry()
    assert len(side_effects()) == n, side_effects()[n:]


def test_additions_are_recorded_without_a_warning(monkeypatch, recwarn):
    import os
    monkeypatch.delenv("OPSADV_TEST_ADDED_VAR", raising=False)

    def add():
        os.environ["OPSADV_TEST_ADDED_VAR"] = "1"
    reg = Registry()
    assert reg.register_plugin(_plugin("adds_a_variable", probe=add)) is not None
    monkeypatch.delenv("OPSADV_TEST_ADDED_VAR")
    assert not [w for w in recwarn if "adds_a_variable" in str(w.message)]
    assert any(s.startswith("adds_a_variable:") and "(kept)" in s for s in side_effects())


def test_a_hung_probe_is_a_timeout_failure(monkeypatch):
    """A probe that never returns costs start-up OPSADV_PROBE_TIMEOUT seconds and is recorded as the plugin's
    failure; the registry does not wait for it (the probe is still blocked when registration returns)."""
    import threading
    release, entered = threading.Event(), threading.Event()

    def hang():
        entered.set()
        release.wait(60)
    monkeypatch.setenv("OPSADV_PROBE_TIMEOUT", "0.2")
    reg = Registry()
    try:
        with pytest.warns(RuntimeWarning, match="skipping plugin hangs_in_probe"):
            assert reg.register_plugin(_plugin("hangs_in_probe", probe=hang)) is None
        assert entered.is_set() and not release.is_set()
    finally:
        release.set()
    (f,) = [f for f in reg.failures if f.name == "hangs_in_probe"]
    assert f.stage == "probe" and f.error.startswith("TimeoutError") and "OPSADV_PROBE_TIMEOUT" in f.error
    assert "hangs_in_probe" not in reg.backends
    assert reg.register_plugin(_plugin("quick_probe")) is not None       # the next plugin loads normally


def test_probe_timeout_setting(monkeypatch):
    import threading

    from opsadv.errors import EnvVarError
    from opsadv.registry import manager
    monkeypatch.delenv("OPSADV_PROBE_TIMEOUT", raising=False)
    assert Registry().probe_timeout == manager.PROBE_TIMEOUT_S == 5.0
    for raw, want in (("2.5", 2.5), (" 10 ", 10.0), ("0", None), ("off", None)):
        monkeypatch.setenv("OPSADV_PROBE_TIMEOUT", raw)
        assert Registry().probe_timeout == want
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv("OPSADV_PROBE_TIMEOUT", bad)
        with pytest.raises(EnvVarError, match="OPSADV_PROBE_TIMEOUT"):
            Registry()
    monkeypatch.setenv("OPSADV_PROBE_TIMEOUT", "0")         # no limit: the probe runs in the caller's thread
    where = []
    assert Registry().register_plugin(_plugin("inline", probe=lambda: where.append(threading.current_thread())))
    assert where == [threading.current_thread()]


def test_side_effects_shown_by_info(monkeypatch, capsys):
    import json

    from opsadv import cli
    monkeypatch.delenv("OPSADV_TEST_INFO_VAR", raising=False)

    def add():
        import os
        os.environ["OPSADV_TEST_INFO_VAR"] = "1"
    Registry().register_plugin(_plugin("shows_in_info", probe=add))
    monkeypatch.delenv("OPSADV_TEST_INFO_VAR")
    inf = opsadv.info()
    (note,) = [s for s in inf.to_dict()["plugin_side_effects"] if s.startswith("shows_in_info:")]
    assert "added OPSADV_TEST_INFO_VAR (kept)" in note
    text = str(inf)
    assert "== plugin side effects" in text and note in text
    assert cli.main(["info", "--json"]) == 0
    assert note in json.loads(capsys.readouterr().out)["plugin_side_effects"]
    assert cli.main(["info"]) == 0
    assert note in capsys.readouterr().out
