"""How an opsadv sharding rule becomes a DTensor op strategy (torch.distributed.tensor's own engine).

A rule sees one mesh dim at a time: each tensor argument as an Arg (global shape, its placement on that mesh dim)
and the plain arguments by their schema names, and returns the placements the op runs with there:
(output placements, {argument name: input placement}).  It raises ShardingError (Call.refuse) for a placement it
cannot run with.  Arguments the rule lists but the caller placed otherwise are left to DTensor to redistribute
only where that cannot change what the caller meant: a Replicate or Partial argument (DTensor slices / reduces
it), or a gradient (`free`: its placement comes from autograd, not from the caller).  Any other mismatch, e.g. an
argument sharded on another dim than the lead's, is refused, so a bad placement is an error naming it rather than
a silent all-gather.

Registered with ShardingPropagator.register_op_strategy, not experimental.register_sharding: register_sharding
keys DTensor's sharding cache only on the arguments from the first int one on (its derive_schema_info), so a
gemm's `activation` or a loss's `reduction` would not be in the key and a verdict for one value would be reused
for another.  Here every argument is in the key (static_argnum=0)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from opsadv.core.errors import ShardingError

R = Replicate()
P = Partial()


def show(p: Placement) -> str:
    if isinstance(p, _StridedShard):
        return f"_StridedShard({p.dim}, split_factor={p.split_factor})"
    return f"{type(p).__name__}({p.dim})" if isinstance(p, Shard) else f"{type(p).__name__}()"


@dataclass(frozen=True)
class Arg:
    """A tensor argument as a rule sees it on one mesh dim."""
    name: str
    shape: tuple[int, ...]
    placement: Placement

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    @property
    def sharded(self) -> bool:
        return isinstance(self.placement, Shard) and not isinstance(self.placement, _StridedShard)

    @property
    def strided(self) -> bool:
        return isinstance(self.placement, _StridedShard)

    @property
    def dim(self) -> int | None:
        """The (non-negative) tensor dim a Shard / _StridedShard splits; None when replicated or partial."""
        return self.placement.dim % self.ndim if isinstance(self.placement, (Shard, _StridedShard)) else None


class Call:
    """One op call on one mesh dim, as a rule reads it."""

    def __init__(self, op: str, values: dict[str, Any], mesh_dim: int, mesh_size: int):
        self.op, self.values, self.mesh_dim, self.mesh_size = op, values, mesh_dim, mesh_size

    def __getitem__(self, name: str):
        return self.values[name]

    def refuse(self, name: str, expected: str, given: str | None = None, why: str = "") -> NoReturn:
        a = self.values.get(name)
        if given is None:
            given = show(a.placement) if isinstance(a, Arg) else repr(a)
        raise ShardingError(self.op, name, f"{expected} on mesh dim {self.mesh_dim}" + (f" ({why})" if why else ""),
                            given)

    def lead(self, name: str, allowed: dict[int, str]) -> int | None:
        """The tensor dim the lead argument `name` is sharded on (one of `allowed`: dim -> what it is), None when
        it is replicated (a Partial lead is reduced to Replicate by DTensor first)."""
        a = self.values[name]
        if not a.sharded and not a.strided:
            return None
        if a.strided or a.dim not in allowed:
            what = {d: w for d, w in allowed.items()}
            ok = " or ".join(f"Shard({d}) ({w})" for d, w in what.items())
            self.refuse(name, f"Replicate()" + (f" or {ok}" if ok else ""),
                        f"{show(a.placement)} (tensor shape {a.shape})")
        return a.dim


Rule = Callable[[Call], "tuple[tuple[Placement, ...], dict[str, Placement]]"]


@dataclass(frozen=True)
class Plan:
    """The placements a call runs with over the whole mesh: per input argument name and per output."""
    inputs: dict[str, tuple[Placement, ...]]
    outputs: tuple[tuple[Placement, ...], ...]

    def describe(self, given: dict[str, tuple[Placement, ...]], out_names: tuple[str, ...]) -> str:
        ins = ", ".join(f"{n} {_seq(given[n])}" + (f" -> {_seq(p)}" if tuple(p) != tuple(given[n]) else "")
                        for n, p in self.inputs.items())
        outs = ", ".join(f"{n} {_seq(p)}" for n, p in zip(out_names, self.outputs))
        return f"{ins} => {outs}"


def _seq(ps) -> str:
    return "[" + ", ".join(show(p) for p in ps) + "]"


def plan(op: str, rule: Rule, values: dict[str, Any], mesh_shape: tuple[int, ...], free: frozenset[str]) -> Plan:
    """Run `rule` on every mesh dim.  values: schema name -> (shape, placements) for a tensor argument, the value
    itself for any other (None for an absent optional tensor)."""
    tensors = {n: v for n, v in values.items() if isinstance(v, _Placed)}
    ins: dict[str, list[Placement]] = {n: [] for n in tensors}
    outs: list[list[Placement]] = []
    for md, size in enumerate(mesh_shape):
        c = Call(op, {n: (Arg(n, v.shape, v.placements[md]) if n in tensors else v) for n, v in values.items()},
                 md, size)
        out_p, in_p = rule(c)
        for n, a in ((n, c[n]) for n in tensors):
            want = in_p.get(n, R)
            given = a.placement
            if given != want and not (given.is_replicate() or given.is_partial() or n in free):
                c.refuse(n, f"{show(want)} with this call's other arguments ({_lead_note(in_p, c)})")
            ins[n].append(want)
        if not outs:
            outs = [[] for _ in out_p]
        for o, p in zip(outs, out_p):
            o.append(p)
    return Plan({n: tuple(p) for n, p in ins.items()}, tuple(tuple(o) for o in outs))


def _lead_note(in_p: dict[str, Placement], c: Call) -> str:
    return ", ".join(f"{n} {show(p)}" for n, p in in_p.items() if isinstance(c[n], Arg) and c[n].placement == p)


@dataclass(frozen=True)
class _Placed:
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]


def _schema_values(op_schema: OpSchema) -> dict[str, Any]:
    """Schema argument name -> value, tensor arguments as _Placed (from their DTensorSpec)."""
    out = {}
    args = op_schema.op._schema.arguments
    for i, a in enumerate(args):
        if i < len(op_schema.args_schema):
            v = op_schema.args_schema[i]
        elif a.name in op_schema.kwargs_schema:
            v = op_schema.kwargs_schema[a.name]
        else:
            v = a.default_value if a.has_default_value() else None
        if isinstance(v, OpStrategy):
            v = v.strategies[0].output_spec
        if isinstance(v, DTensorSpec):
            v = _Placed(tuple(v.tensor_meta.shape), tuple(v.placements))
        out[a.name] = v
    return out


def _strategy(op: str, rule: Rule, free: frozenset[str], op_schema: OpSchema) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    values = _schema_values(op_schema)
    p = plan(op, rule, values, tuple(mesh.shape), free)
    names = [a.name for a in op_schema.op._schema.arguments]
    # DTensor matches input_specs with the DTensor arguments in positional order
    input_specs = [DTensorSpec(mesh, p.inputs[names[i]], tensor_meta=v.strategies[0].output_spec.tensor_meta)
                   for i, v in enumerate(op_schema.args_schema) if isinstance(v, OpStrategy)]
    outs = tuple(DTensorSpec(mesh, o) for o in p.outputs)
    out_specs = outs if len(op_schema.op._schema.returns) != 1 else outs[0]
    costs = [[0.0] for _ in input_specs]
    return OpStrategy([OpSpec(output_specs=out_specs, input_specs=input_specs, redistribute_cost=costs)])


# every registered rule: op overload name (e.g. "flash_attention_backward") -> (rule, free argument names)
RULES: dict[str, tuple[Rule, frozenset[str]]] = {}


def register(name: str, rule: Rule, free: tuple[str, ...] = ()) -> None:
    """The rule of torch.ops.opsadv.<name>.default, with DTensor's sharding propagator."""
    import torch
    from functools import partial
    overload = getattr(torch.ops.opsadv, name).default
    op = name.removesuffix("_backward")
    RULES[name] = (rule, frozenset(free))
    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
        overload, partial(_strategy, op, rule, frozenset(free)),
        RuntimeSchemaInfo(static_argnum=0, static_kwargkey=[a.name for a in overload._schema.arguments]))


def placed(t) -> _Placed:
    """A DTensor's (global shape, placements), as plan() reads a tensor argument."""
    return _Placed(tuple(t.shape), tuple(t.placements))
