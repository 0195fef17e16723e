from opsadv.registry import BackendInfo, ProbeResult, hookimpl


@hookimpl
def opsadv_backend_info():
    return BackendInfo(name="broken_register", device_types=("cpu",), version="6.6.6")


@hookimpl
def opsadv_probe(env):
    return ProbeResult(True)


@hookimpl
def opsadv_register_kernels(registry, env):
    raise RuntimeError("deliberate failure while registering kernels")
