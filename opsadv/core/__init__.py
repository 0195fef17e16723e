"""opsadv.core: op IR, dispatch, capability detection, policy, errors.  Imports no backend."""
