"""Resolution: pick the kernel impl for a call, with reasons; memoized per
(policy, op, direction, shape bucket) so the hot path is one dict lookup."""
from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

from . import devices, hooks, tuning
from .env import EnvInfo
from .envvars import env_bool
from .errors import BackendUnavailableError, NoKernelError
from .kernel import CallSpec, KernelImpl, Profile, ResolveContext, profile_with_tile_cap
from .policy import Policy, current_policy, select_profile
from .precision import requested
from .policy import current_policy as _scoped_or_global  # hot-path alias
from .resolved import Resolved

log = logging.getLogger("opsadv.dispatch")


@dataclass(frozen=True)
class Candidate:
    impl: KernelImpl
    accepted: bool
    reasons: tuple[str, ...]
    chosen: bool = False
    priority: int | None = None     # for this call (KernelImpl.priority_for); None: the static one
    ranked: str = ""                # why it differs from the static priority ("" where it does not)
    applies: tuple[str, ...] = ()   # the call's policy requests (tile_size, precision fields) it applies ...
    ignores: tuple[str, ...] = ()   # ... and those it ignores (KernelImpl.honours), as "softmax=bf16"

    @property
    def rank_priority(self) -> int:
        return self.impl.priority if self.priority is None else self.priority


@dataclass(frozen=True)
class Explanation:
    """Every candidate impl for one call, with accept/reject reasons.  Printable as a table."""

    op: str
    spec: CallSpec
    policy: str
    candidates: tuple[Candidate, ...]
    chosen: str | None
    why: str
    placements: str = ""     # a call on DTensors: input placements -> the ones it runs with => output placements

    def __str__(self) -> str:
        head = (f"opsadv.{self.op} [{self.spec.device_type} {str(self.spec.dtype).replace('torch.', '')}"
                f" bucket={self.spec.bucket_text()} features={sorted(self.spec.features)}"
                f"{' backward' if self.spec.backward else ''}"
                f"{' train (grad-recording forward: timed fwd+bwd)' if self.spec.train else ''}"
                f"{' inference (no-grad forward, statistics unread)' if self.spec.inference else ''}] under {self.policy}")
        rows = [head] + ([f"  placements (per mesh dim): {self.placements}"] if self.placements else [])
        rows.append(f"  {'':2} {'impl':42} {'prio':>5}  verdict")
        for c in self.candidates:
            mark = "->" if c.chosen else "  "
            verdict = "accepted" if c.accepted else "rejected: " + "; ".join(c.reasons)
            if c.accepted and c.reasons:
                verdict += " (" + "; ".join(c.reasons) + ")"
            if c.accepted and (c.applies or c.ignores):
                verdict += " (" + "; ".join(f"{w} {', '.join(x)}" for w, x in (("applies", c.applies),
                                                                                ("ignores", c.ignores)) if x) + ")"
            if c.ranked:
                verdict += f" [priority {c.rank_priority} here, {c.impl.priority} static: {c.ranked}]"
            rows.append(f"  {mark} {c.impl.id:42} {c.rank_priority:>5}  {verdict}")
        rows.append(f"  chosen: {self.chosen or 'none'} -- {self.why}")
        return "\n".join(rows)

    def _repr_markdown_(self) -> str:  # notebooks
        return "```\n" + str(self) + "\n```"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "policy": self.policy, "chosen": self.chosen, "why": self.why,
                "placements": self.placements,
                "candidates": [{"impl": c.impl.id, "backend": c.impl.backend, "priority": c.rank_priority,
                                "static_priority": c.impl.priority, "ranked": c.ranked,
                                "accepted": c.accepted, "chosen": c.chosen, "reasons": list(c.reasons),
                                "applies": list(c.applies), "ignores": list(c.ignores)}
                               for c in self.candidates]}


# The ops' per-call fast path (opsadv/ops/<op>/): (op tag, policy serial, the call's exact argument metadata:
# tensor types, dtypes, devices, shapes, flags and float values) -> the Resolved its memoized bucket gave.  A
# key is stored only after that exact call passed the op's full validation and resolved, so a hit may skip
# both (everything they read is in the key).  Derived from _memo: every write to _memo empties it.
_fast: dict[tuple, Resolved] = {}
FAST_MAX = 4096          # entries before it is emptied (exact shapes: a decode loop adds one per new kv length)
_fast_off = False        # dispatch.call replaced (a test's spy): no new fast entries, so the spy sees every call


class _Memo(dict):
    """The memo; any write also empties the fast-path cache built over it (resolve() writes only on a miss)."""
    __slots__ = ()

    def __setitem__(self, k, v):
        dict.__setitem__(self, k, v)
        _fast.clear()

    def __delitem__(self, k):
        dict.__delitem__(self, k)
        _fast.clear()

    def clear(self):
        dict.clear(self)
        _fast.clear()

    def pop(self, *a):
        _fast.clear()
        return dict.pop(self, *a)

    def popitem(self):
        _fast.clear()
        return dict.popitem(self)

    def setdefault(self, k, v=None):
        _fast.clear()
        return dict.setdefault(self, k, v)

    def update(self, *a, **kw):
        dict.update(self, *a, **kw)
        _fast.clear()


_memo: dict[tuple, Resolved] = _Memo()      # (policy serial: its content, bucket key) -> Resolved
MEMO_MAX = 16384
_memo_lock = threading.Lock()
_logged_fallback: set[str] = set()
_logged_ignored: set[tuple] = set()      # (op, impl, "field=value") already warned about
_tracers: list["Trace"] = []     # every active trace (the ops' "is anyone tracing" check); mutated in place
_all_threads: list["Trace"] = []  # the active trace(all_threads=True) ones: they count every thread's calls
_local: ContextVar[tuple["Trace", ...]] = ContextVar("opsadv_traces", default=())   # this context's traces
_trace_lock = threading.Lock()


def clear_cache() -> None:
    with _memo_lock:
        _memo.clear()


hooks.on_registry_reset(clear_cache)     # a rebuilt registry has other impls: no memoized choice survives


def learn(fast_key: tuple | None, key: tuple, r: Resolved | None = None) -> None:
    """After an op call took the full path (validated, resolved under the current policy, run): remember
    the resolution of its bucket `key` (or `r`) under the call's `fast_key` for the next identical call."""
    if fast_key is None or _fast_off or tuning.is_deferred():     # (deferred: an untuned choice must not stick)
        return
    if r is None:
        r = _memo.get((current_policy().serial, key))
        if r is None:
            return
    if len(_fast) >= FAST_MAX:
        _fast.clear()
    _fast[fast_key] = r


_capped_profiles: dict[tuple[int, int], Profile] = {}


def _capped(profile: Profile, tile_size: int) -> Profile:
    """The profile under the seed's tile_size option (built once per profile and size)."""
    key = (id(profile), tile_size)
    p = _capped_profiles.get(key)
    if p is None:
        p = _capped_profiles[key] = profile_with_tile_cap(profile, tile_size)
    return p


def _selected_backends(policy: Policy, spec: CallSpec):
    reg = hooks.get_registry()
    if policy.backend == "auto":
        return reg, [b for b in reg.available()]
    rec = reg.backends.get(policy.backend)
    if rec is None or not rec.available:
        raise BackendUnavailableError(policy.backend, list(rec.probe.reasons) if rec else
                                      [f"not registered; registered backends: {sorted(reg.backends)}"])
    return reg, [rec]


def explain_spec(spec: CallSpec, policy: Policy | None = None) -> tuple[Explanation, Resolved | None]:
    """Full resolution (no memo): every registered impl of the op with its verdict."""
    policy = policy or current_policy()
    reg, selected = _selected_backends(policy, spec)
    names = {b.name for b in selected}
    env: EnvInfo = reg.env.for_device(spec.device_index)
    cands: list[Candidate] = []
    pinned = dict(policy.impls).get(spec.op)
    for impl in reg.impls_by_op.get(spec.op, []):
        if pinned is not None and impl.id != pinned:
            cands.append(Candidate(impl, False, (f"policy pins {spec.op} to {pinned!r}",)))
            continue
        if impl.backend not in names:
            cands.append(Candidate(impl, False, (f"backend {impl.backend!r} not selected by policy",)))
            continue
        if policy.backend == "auto" and policy.strict and impl.backend == "reference" and len(names) > 1:
            cands.append(Candidate(impl, False, ("strict policy: no reference fallback",)))
            continue
        why = impl.rejection_reasons(spec, env, experimental_ok=policy.experimental,
                                     deterministic=policy.deterministic)
        prio, ranked = impl.priority_for(spec, env) if not why else (impl.priority, "")
        cands.append(Candidate(impl, not why, tuple(why), priority=prio, ranked=ranked))
    accepted = sorted((c for c in cands if c.accepted), key=lambda c: (-c.rank_priority, c.impl.id))
    chosen: KernelImpl | None = None
    why = ""
    if accepted:
        chosen = accepted[0].impl
        top = accepted[0]
        why = (f"highest priority ({top.rank_priority}{': ' + top.ranked if top.ranked else ''}) "
               f"of {len(accepted)} accepted")
        measured = tuning.lookup(spec, [c.impl.id for c in accepted], env, policy.timing)
        if measured is not None:
            chosen = next(c.impl for c in accepted if c.impl.id == measured.winner)
            why = measured.describe()
    cands.sort(key=lambda c: (not c.accepted, -c.rank_priority, c.impl.id))
    cands = [Candidate(c.impl, c.accepted, c.reasons, chosen is not None and c.impl.id == chosen.id, c.priority,
                       c.ranked, *_requests(c, spec, policy)) for c in cands]
    exp = Explanation(spec.op, spec, policy.describe(), tuple(cands), chosen.id if chosen else None, why)
    if chosen is None:
        return exp, None
    backend = reg.backends[chosen.backend]
    profile = select_profile(backend, policy, env) if backend.profiles else None
    options = policy.option_dict if policy.backend in (chosen.backend, "auto") else {}
    if profile is not None and options.get("tile_size"):
        profile = _capped(profile, options["tile_size"])
    ctx = ResolveContext(env=env, profile=profile, options={**options, "precision": policy.precision,
                                                             "deterministic": policy.deterministic}, spec=spec)
    run = chosen.backward if spec.backward else chosen.fn
    return exp, devices.guarded(Resolved(chosen, ctx, run))


def _ignored_precision(impl, spec: CallSpec, policy: Policy) -> list[str]:
    """The precision fields ("softmax=bf16", ...) this call asks for that the impl does not honour (tile_size, a
    cap some impls cannot take, is only listed by explain)."""
    req = requested(policy.precision, spec.op, spec.dtype)
    return [f"{k}={v}" for k, v in req.items() if k not in impl.honours]


def _requests(c: Candidate, spec: CallSpec, policy: Policy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(applied, ignored) policy requests of an accepted candidate: the seed's tile_size (where the policy's
    options reach its backend) and the precision fields that concern this op and dtype."""
    if not c.accepted:
        return (), ()
    tile = policy.option_dict.get("tile_size") if policy.backend in (c.impl.backend, "auto") else None
    req = requested(policy.precision, spec.op, spec.dtype, tile)
    applies = tuple(f"{k}={v}" for k, v in req.items() if k in c.impl.honours)
    return applies, tuple(f"{k}={v}" for k, v in req.items() if k not in c.impl.honours)


def resolve(key: tuple, make_spec: Callable[[], CallSpec], args: tuple | None = None) -> Resolved:
    """The hot path: one dict lookup; on a miss, full resolution + one log line."""
    policy = current_policy()
    mkey = (policy.serial, key)
    r = _memo.get(mkey)
    if r is not None:
        return r
    spec = make_spec()
    exp, r = explain_spec(spec, policy)
    if r is None:
        reasons = {c.impl.id: list(c.reasons) for c in exp.candidates}
        raise NoKernelError(spec.op + (" (backward)" if spec.backward else ""), policy.describe(), reasons)
    if policy.autotune and args is not None:
        if tuning.is_deferred():        # (tuning.deferred: no measurement, and no memo that would skip one later)
            log.debug("%s: %s served untuned (tuning deferred)", spec.op, r.impl.id)
            return r
        with devices.inputs_device(args):
            r = devices.guarded(tuning.autotune(exp, r, args, policy.timing) or r)
    _announce(exp, r, policy)
    with _memo_lock:
        if len(_memo) >= MEMO_MAX:      # many distinct policies x buckets: start over rather than grow without end
            _memo.clear()
        _memo[mkey] = r
    return r


def _announce(exp: Explanation, r: Resolved, policy: Policy) -> None:
    why = exp.why
    if r.why:       # autotune replaced the explanation's choice: say what decided, and what it replaced
        why = r.why + (f"; priority alone would pick {exp.chosen}" if exp.chosen and exp.chosen != r.impl.id else "")
    line = (f"opsadv: {exp.op}{' backward' if exp.spec.backward else ''} {exp.spec.device_type} "
            f"{str(exp.spec.dtype).replace('torch.', '')} bucket={exp.spec.bucket_text()} -> {r.impl.id} ({why})")
    if env_bool("OPSADV_LOG_DISPATCH"):
        print(line, file=sys.stderr)
    log.info(line)
    if log.isEnabledFor(logging.DEBUG):     # memo misses only: the hot path never gets here
        log.debug("%s candidates: %s", exp.op, "; ".join(
            f"{c.impl.id} " + (("chosen" if c.impl.id == r.impl.id else "accepted") + f" (priority {c.rank_priority})"
                               if c.accepted else "refused: " + ", ".join(c.reasons)) for c in exp.candidates))
    ignored = [q for q in _ignored_precision(r.impl, exp.spec, policy) if (exp.op, r.impl.id, q) not in _logged_ignored]
    if ignored:
        _logged_ignored.update((exp.op, r.impl.id, q) for q in ignored)
        honour = [c.impl.id for c in exp.candidates if c.accepted and all(
            q.split("=")[0] in c.impl.honours for q in ignored)]
        warnings.warn(f"opsadv: {exp.op} runs {r.impl.id}, which ignores the policy's {', '.join(ignored)} (it "
                      "computes in its own precision); " + (f"{', '.join(honour)} would honour it (pin it with "
                      "use_backend(..., impls=...))" if honour else "no accepted impl honours it")
                      + ". opsadv.explain() lists what each impl applies and ignores.", RuntimeWarning, stacklevel=4)
    if r.impl.backend == "reference" and policy.backend == "auto":
        device_backends = [b.name for b in hooks.get_registry().available()
                           if b.name != "reference" and exp.spec.device_type in b.info.device_types]
        if device_backends and exp.op not in _logged_fallback:
            _logged_fallback.add(exp.op)
            rej = "; ".join(f"{c.impl.id}: {', '.join(c.reasons)}" for c in exp.candidates
                            if not c.accepted and c.impl.backend in device_backends)
            warnings.warn(f"opsadv: {exp.op} falls back to the reference backend although {device_backends} "
                          f"is available ({rej}). opsadv.explain() shows why.", RuntimeWarning, stacklevel=4)


class Trace:
    """`with opsadv.trace() as t:` counts the op calls of this thread / async context per impl (t.counts,
    str(t)); all_threads=True counts every thread's calls (e.g. autograd's device threads running a CUDA
    backward, which are other threads)."""

    def __init__(self, all_threads: bool = False):
        self.all_threads = all_threads
        self.counts: Counter[str] = Counter()
        self._tokens: list = []

    def __enter__(self) -> "Trace":
        with _trace_lock:
            if self.all_threads:
                _all_threads.append(self)
            else:
                self._tokens.append(_local.set(_local.get() + (self,)))
            _tracers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _trace_lock:
            _tracers.remove(self)
            if self.all_threads:
                _all_threads.remove(self)
            else:
                _local.reset(self._tokens.pop())

    def __str__(self) -> str:
        return "\n".join(f"{n:8d}  {impl}" for impl, n in self.counts.most_common()) or "(no opsadv calls)"


def record(impl_id: str, n: int = 1) -> None:
    for t in _local.get():
        t.counts[impl_id] += n
    if _all_threads:
        with _trace_lock:       # several threads add to one Counter: += is no atomic update
            for t in _all_threads:
                t.counts[impl_id] += n


def record_carried(impl_id: str, carried: tuple) -> None:
    """record() for a backward that may run outside its forward's context (autograd's device thread): counted in
    this context's traces and in the forward's (`carried`, those still open), each once."""
    here = _local.get()
    for t in here:
        t.counts[impl_id] += 1
    for t in carried:
        if t not in here and t in _tracers:
            t.counts[impl_id] += 1
    if _all_threads:
        with _trace_lock:
            for t in _all_threads:
                t.counts[impl_id] += 1


def record_call(impl_id: str) -> None:
    """For ops that run a resolved impl themselves (not through call()): count it in active traces."""
    if _tracers:
        record(impl_id)


def call(key: tuple, make_spec: Callable[[], CallSpec], args: tuple, inference: bool = False) -> Any:
    """Resolve (memoized) and run.  `args` are the op's positional arguments.  inference=True: an eager
    forward whose statistics outputs nobody can read (no grad, no tracing) runs the impl's `inference`
    function where it has one (it may return None for those outputs)."""
    r = _memo.get((_scoped_or_global().serial, key))
    if r is None:
        r = resolve(key, make_spec, args)
    if _tracers:
        record(r.impl.id)
    return (r.infer if inference else r.run)(r.ctx, *args)


_CALL = call


class _Module(type(sys)):
    """Replacing dispatch.call (tests spy on it) turns the ops' fast path off, which would bypass the spy:
    the fast cache is emptied and stays empty until the real call is back."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "call":
            global _fast_off
            _fast_off = value is not _CALL
            _fast.clear()


sys.modules[__name__].__class__ = _Module


def _after_fork() -> None:
    global _memo_lock
    _memo_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
