"""opsadv.explain on DTensor arguments: the placements the op's sharding rule chose (inputs as given -> as the op
runs with them, and the outputs), and the kernel choice for each rank's local shards, which is what runs."""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from opsadv.core import explain as _explain
from opsadv.core.opdef import get_op

from . import vocab_parallel
from .strategy import RULES, _Placed, placed, plan

OUTPUTS = {
    "flash_attention": ("out", "lse"), "sparse_attention": ("out", "lse"), "paged_attention": ("out", "lse"),
    "paged_attention_append": ("out", "lse"), "varlen_attention": ("out", "lse"), "gemm": ("out",),
    "swiglu_gemm": ("out",), "swiglu": ("out",), "layer_norm": ("y", "xsum", "mean", "rstd"),
    "rms_norm": ("y", "xsum", "rstd"), "rotary_embedding": ("q_out", "k_out"), "qk_norm_rotary": ("q_out", "k_out"),
    "linear_cross_entropy": ("loss", "lse", "dh", "dw", "db"), "attention_merge_": (),
}


def _schema_inputs(op: str, pub: dict) -> tuple[str, dict]:
    """(the custom op a public call runs, its arguments by schema name) from the public call's bound arguments."""
    name = op
    pub = dict(pub)
    if op == "sparse_attention":
        lay = pub["layout"]
        w = lay.window
        pub.update(block_mask=lay.block_mask, key_padding_mask=lay.key_padding_mask, cu_seqlens=lay.cu_seqlens,
                   block_size=lay.block_size, causal=lay.causal, window_left=-1 if w is None else w[0],
                   window_right=-1 if w is None else w[1], num_global=lay.num_global)
    elif op == "paged_attention" and pub.get("k_new") is not None:
        name = "paged_attention_append"
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in pub.values())
    if op == "gemm" and grad:
        pub["activation"] = "none"           # a grad-recording call runs the activation as a torch op after the op
    if op == "linear_cross_entropy":
        pub["grads_in_forward"] = grad and pub.get("reduction") != "none"
    schema = getattr(torch.ops.opsadv, name).default._schema
    values = {}
    for a in schema.arguments:
        v = pub.get(a.name, a.default_value if a.has_default_value() else None)
        if isinstance(v, DTensor):
            v = placed(v)
            if op == "linear_cross_entropy" and a.name in ("hidden", "labels"):   # the op sees (N, H) and (N,)
                v = _Placed((-1, v.shape[-1]) if a.name == "hidden" else (-1,), v.placements)
        values[a.name] = v
    return name, values


def _local(t: DTensor, placements) -> torch.Tensor:
    """t's local shard under `placements` (its own shard where those are its placements; else an empty tensor of
    the shard's shape: explain reads shapes, and must not communicate)."""
    if tuple(t.placements) == tuple(placements):
        return t.to_local()
    shape, _ = compute_local_shape_and_global_offset(t.shape, t.device_mesh, list(placements))
    loc = t.to_local()
    return torch.zeros(shape, dtype=loc.dtype, device=loc.device)


def planner(op: str, args: tuple, kwargs: dict, backward: bool):
    d = get_op(op)
    bound = inspect.signature(d.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    pub = dict(bound.arguments)
    layout = pub.get("layout")
    lay_fields = {} if layout is None else {"block_mask": layout.block_mask,
                                            "key_padding_mask": layout.key_padding_mask,
                                            "cu_seqlens": layout.cu_seqlens}
    mesh = next((t.device_mesh for t in (*pub.values(), *lay_fields.values()) if isinstance(t, DTensor)), None)
    if mesh is None:
        return None
    if op == "linear_cross_entropy" and vocab_parallel.is_vocab_split(pub["weight"]):
        s_args, s_kwargs, text = vocab_parallel.explain_plan(pub["hidden"], pub["weight"], pub["labels"],
                                                             pub["bias"], pub["reduction"], pub["ignore_index"],
                                                             pub["softcap"])
        if backward:
            text += " (the forward's; the backward recomputes each chunk's logits on the same shards)"
        return s_args, s_kwargs, text, vocab_parallel.NOTE, vocab_parallel.STATS_OP
    name, values = _schema_inputs(op, pub)
    if name not in RULES:
        return None
    rule, free = RULES[name]
    p = plan(op, rule, values, tuple(mesh.shape), free)
    given = {n: v.placements for n, v in values.items() if isinstance(v, _Placed)}
    text = p.describe(given, OUTPUTS.get(name, tuple(f"out{i}" for i in range(len(p.outputs)))))
    if backward:
        text += " (the forward's; its backward splits the inputs alike)"

    def local(n, t):
        return _local(t, p.inputs[n]) if isinstance(t, DTensor) and n in p.inputs else (
            t.to_local() if isinstance(t, DTensor) else t)
    new = {n: local(n, t) for n, t in pub.items()}
    if layout is not None:
        new["layout"] = dataclasses.replace(layout, **{n: local(n, t) for n, t in lay_fields.items()})
    return _rebind(d, args, kwargs, new) + (text,)


def _rebind(d, args: tuple, kwargs: dict, new: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of the call with each argument replaced by its value in `new` (by name)."""
    sig = inspect.signature(d.fn)
    pos = [n for n, prm in sig.parameters.items() if prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD)]
    return tuple(new[n] for n in pos[:len(args)]), {n: new[n] for n in kwargs}


def install() -> None:
    _explain.install_placement_planner(planner)
