"""Converted models under PyTorch's parallel engine (docs/distributed.md): a tiny Llama (a vocabulary of 131, odd: the
vocab-parallel lm_head's shards are uneven) on CPU ranks (gloo), the reference backend.  On 2 ranks: tensor parallel
(torch's Llama plan with a vocab-parallel lm_head, applied before and after convert_model; transformers' tp_plan),
FSDP2 (with and without a bf16 MixedPrecisionPolicy) and DDP.  On 4 ranks, a 2 x 2 ("dp", "tp") mesh: the plan on
the "tp" sub-mesh and fully_shard on "dp", both orders of conversion, and sequence-parallel norms.  Each case trains
one step whose loss and every gradient (gathered with full_tensor()) match a single-process run of the unconverted
model on the same weights and the whole batch.  All cases of a world size run in one spawn (a spawn costs seconds);
each rank returns its failures, one message per case."""
import json
import os
import random
import socket
import traceback

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.xdist_group("distributed_models"),
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]

WORLD = 2
SEQ = 13                    # odd: no length is a multiple of a block or of the ranks
BATCH_PER_RANK = 2
LAYERS = 2
VOCAB = 131                 # odd: lm_head's vocabulary shards are uneven (66 / 65 rows)


def _config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def _model(seed: int, dtype):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    m = LlamaForCausalLM(_config()).to(dtype)
    with torch.no_grad():                  # (zero-initialized norms would hide a wrong norm gradient)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
        m.lm_head.weight.mul_(10.0)        # logits of O(1), not 0.02: the loss then depends on the target logit
    return m


def _torch_plan(lm_head: bool = True):
    """torch's Llama plan; lm_head split over the vocabulary with gathered logits (the model's own loss needs them),
    which the fused loss runs vocab-parallel."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())} if lm_head else {}
    for i in range(LAYERS):
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{n}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        for n in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{n}"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def _hf_tp(seed, dtype, mesh, ckpt):
    """The model through transformers' own tensor parallelism (the config's base_model_tp_plan): from_pretrained with
    DistributedConfig(tp_size=2) where accelerate is installed (it needs it for device maps), else the same
    styles applied by transformers' apply_tensor_parallelism."""
    import importlib.util
    from transformers import LlamaForCausalLM
    if importlib.util.find_spec("accelerate") is not None:
        from transformers.distributed import DistributedConfig
        if dist.get_rank() == 0:
            _model(seed, dtype).save_pretrained(ckpt)
        dist.barrier()
        return LlamaForCausalLM.from_pretrained(ckpt, distributed_config=DistributedConfig(tp_size=WORLD), dtype=dtype)
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    m = _model(seed, dtype)
    return apply_tensor_parallelism(m, mesh, m._expand_parallel_plan(m.tp_plan))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compare(name, model, loss, ref_loss, ref_grads, tol) -> list[str]:
    errs = []
    if _rel(loss.detach(), ref_loss) > tol:
        errs.append(f"{name}: loss {loss.item():.10g} vs {ref_loss.item():.10g}")
    seen = set()
    for n, p in model.named_parameters():
        n = n.removeprefix("module.")
        seen.add(n)
        if p.grad is None:
            errs.append(f"{name}: {n} got no gradient")
            continue
        e = _rel(_full(p.grad), ref_grads[n])
        if not e <= tol:
            errs.append(f"{name}: {n} gradient rel err {e:.3g} > {tol:g}")
    missing = set(ref_grads) - seen
    if missing:
        errs.append(f"{name}: parameters missing from the model: {sorted(missing)}")
    return errs


def _reference(seed, dtype, ids):
    ref = _model(seed, dtype)
    out = ref(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _cases(rank, seed, ckpt):
    import opsadv
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from opsadv.core.errors import InvalidArgumentError

    results = []
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (WORLD * BATCH_PER_RANK, SEQ), generator=gen)   # the same on every rank
    mine = ids[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]              # data parallel: this rank's rows
    same = ids[:BATCH_PER_RANK]                                                 # tensor parallel: one batch
    f64 = torch.float64
    ref64 = _reference(seed, f64, ids)
    tp_ref = _reference(seed, f64, same)
    tol = 1e-6                                 # (float64, but transformers' loss and RMSNorm compute in float32)

    def train(model, batch):
        model.train()
        out = model(batch, labels=batch)
        out.loss.backward()
        fused = getattr(model, "module", model).opsadv_report
        if out.logits is not None and any(c.kind == "fused" and "ForCausalLMLoss" in c.what for c in fused.changes):
            results.append("the fused lm_loss did not run (the call returned logits)")
        return out.loss

    def train_dp(model):
        """This rank's loss and gradients; the loss averaged over the ranks (equal token counts: the loss of the
        whole batch) as the data-parallel gradients are."""
        loss = train(model, mine).detach().clone()
        dist.all_reduce(loss)
        return loss / WORLD

    def tp_before():
        m = _model(seed, f64)
        parallelize_module(m, mesh, _torch_plan())
        m = opsadv.convert_model(m)
        return m, train(m, same), tp_ref

    def tp_after():
        m = opsadv.convert_model(_model(seed, f64))
        parallelize_module(m, mesh, _torch_plan())     # lm_head split over the vocabulary: vocab-parallel loss
        return m, train(m, same), tp_ref

    def tp_transformers():
        m = opsadv.convert_model(_hf_tp(seed, f64, mesh, ckpt))
        return m, train(m, same), tp_ref

    def fsdp():
        m = opsadv.convert_model(_model(seed, f64))
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        return m, train_dp(m), ref64

    def ddp():
        m = torch.nn.parallel.DistributedDataParallel(opsadv.convert_model(_model(seed, f64)))
        return m, train_dp(m), ref64

    checks = {"tp_before": tp_before, "tp_after": tp_after, "tp_transformers": tp_transformers,
              "fsdp": fsdp, "ddp": ddp}
    fused_expected = {"tp_before", "tp_after", "fsdp", "ddp"}
    for name, case in checks.items():
        try:
            m, loss, (ref_loss, ref_grads) = case()
            errs = _compare(name, m, loss, ref_loss, ref_grads, tol)
            report = getattr(m, "module", m).opsadv_report
            kinds = [c.kind for c in report.changes]
            if name in fused_expected and kinds.count("fused") < 2 * LAYERS:
                errs.append(f"{name}: q|k|v and gate|up not fused: {report}")
            if not any(c.kind == "fused" and "ForCausalLMLoss" in c.what for c in report.changes):
                errs.append(f"{name}: the loss was not fused (lm_loss): {report}")
            results += errs
        except Exception:                     # noqa: BLE001 - one case's failure must not hide the others'
            results.append(f"{name}: {traceback.format_exc()[-1500:]}")
        dist.barrier()

    # FSDP2 with bf16 parameters and float32 gradient reduction: bf16 math (gradients off by up to ~1.2e-2), against the
    # float32 unconverted run; a missing or stale gradient is off by O(1)
    try:
        ref32 = _reference(seed, torch.float32, ids)
        m = opsadv.convert_model(_model(seed, torch.float32))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in m.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        results += _compare("fsdp_bf16", m, train_dp(m), *ref32, tol=4e-2)
    except Exception:                         # noqa: BLE001
        results.append(f"fsdp_bf16: {traceback.format_exc()[-1500:]}")

    # inference under tensor parallelism (no-grad calls take other kernels: swiglu_gemm, transformers' local path)
    try:
        with torch.no_grad():
            ref_logits = _model(seed, f64)(same).logits
            for name, m in (("tp_before", _parallel_then_convert(seed, mesh)),
                            ("tp_transformers", opsadv.convert_model(_hf_tp(seed, f64, mesh, ckpt)))):
                m.eval()
                e = _rel(_full(m(same).logits), ref_logits)
                if not e <= tol:
                    results.append(f"{name} inference: logits rel err {e:.3g}")
    except Exception:                         # noqa: BLE001
        results.append(f"tp inference: {traceback.format_exc()[-1500:]}")

    # greedy generate over opsadv's paged KV cache under tensor parallelism (plan before conversion, and transformers'
    # own tp_plan): each rank's pages hold its local kv head, and the tokens are the single-process model's
    try:
        with torch.no_grad():
            mask = torch.ones_like(same)
            mask[0, :3] = 0                                # a left-padded row: the cache compacts it
            want = _model(seed, f64).generate(same, attention_mask=mask, max_new_tokens=6, do_sample=False)
            for name, m in (("tp_before", _parallel_then_convert(seed, mesh)),
                            ("tp_transformers", opsadv.convert_model(_hf_tp(seed, f64, mesh, ckpt)))):
                m.eval()
                for static in (False, True):
                    cache = opsadv.PagedKVCache(m, max_cache_len=32, page_size=8, static=static,
                                                max_batch_size=same.shape[0])
                    got = m.generate(same, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                                     do_sample=False)
                    heads = cache.layers[0].keys.shape[2]
                    if not torch.equal(got, want) or heads != 2 // WORLD or cache.calls["decode"] == 0:
                        results.append(f"{name} paged generate (static={static}): tokens {got.tolist()} vs "
                                       f"{want.tolist()}, {heads} kv heads in the pages, calls {cache.calls}")
    except Exception:                         # noqa: BLE001
        results.append(f"tp paged generate: {traceback.format_exc()[-1500:]}")

    # converting after fully_shard or inside DDP is refused, naming the order to use
    for name, wrap, says in (("fsdp_then_convert", fully_shard, "convert first, then fully_shard"),
                             ("ddp_then_convert", torch.nn.parallel.DistributedDataParallel, "convert it first")):
        try:
            opsadv.convert_model(wrap(_model(seed, f64)))
            results.append(f"{name}: convert_model accepted a wrapped model")
        except InvalidArgumentError as e:
            if says not in str(e):
                results.append(f"{name}: unclear refusal: {e}")
        except Exception:                     # noqa: BLE001
            results.append(f"{name}: {traceback.format_exc()[-1500:]}")
    return results


def _parallel_then_convert(seed, mesh):
    import opsadv
    from torch.distributed.tensor.parallel import parallelize_module
    m = _model(seed, torch.float64)
    parallelize_module(m, mesh, _torch_plan())
    return opsadv.convert_model(m)


# ---- 4 ranks: a 2 x 2 ("dp", "tp") mesh -------------------------------------------------------------------------
DP = TP = 2


def _sequence_parallel_plan():
    """torch's Llama plan with sequence parallelism: the residual stream a DTensor split over the sequence (Shard(1))
    on the "tp" mesh, every norm SequenceParallel (the converted norms run opsadv.rms_norm on the split tokens),
    attention and MLP inputs all-gathered, o / down reduce-scattered; lm_head's input all-gathered by the fused loss
    (vocab-parallel) or by its plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        plan |= {p + "input_layernorm": SequenceParallel(), p + "post_attention_layernorm": SequenceParallel(),
                 p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                 p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                 p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                 p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
        plan |= {p + f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {p + f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
    return plan


def _cases_2d(rank, seed, ckpt):
    """TP on "tp" x FSDP2 on "dp", float32, against the single-process float32 run of the unconverted model on the
    whole batch (each dp group trains its half; equal token counts, so FSDP's averaged gradients are the whole
    batch's); and the vocab-parallel op with its tokens split over "dp"."""
    import opsadv
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (DP * BATCH_PER_RANK, SEQ), generator=gen)
    mine = ids[dp_rank * BATCH_PER_RANK:(dp_rank + 1) * BATCH_PER_RANK]
    f32 = torch.float32
    ref = _reference(seed, f32, ids)
    tol = 5e-6                                 # (float32 runs differ by up to ~6e-7)
    results = []

    def shard(m):
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return m

    def train(m):
        m.train()
        out = m(mine, labels=mine)
        out.loss.backward()
        if getattr(m, "opsadv_report", None) is not None and out.logits is not None:
            results.append("the fused lm_loss did not run (the call returned logits)")
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)                 # (the tp ranks of a dp group hold the same loss)
        return loss / (DP * TP)

    def unconverted():
        m = _model(seed, f32)
        parallelize_module(m, mesh["tp"], _torch_plan())
        return shard(m)

    def tp_then_convert():
        m = _model(seed, f32)
        parallelize_module(m, mesh["tp"], _torch_plan())
        return shard(opsadv.convert_model(m))

    def convert_then_tp():
        m = opsadv.convert_model(_model(seed, f32), floor=False)
        parallelize_module(m, mesh["tp"], _torch_plan())
        return shard(m)

    def sequence_parallel():
        m = opsadv.convert_model(_model(seed, f32), floor=False)
        parallelize_module(m, mesh["tp"], _sequence_parallel_plan())
        with opsadv.trace() as t:
            m = shard(m)
            loss = train(m)
        if not t.counts.get("reference.rms_norm"):
            results.append(f"sequence_parallel: the converted norms did not run opsadv.rms_norm: {dict(t.counts)}")
        return m, loss

    for name, case in (("unconverted", unconverted), ("tp_then_convert", tp_then_convert),
                       ("convert_then_tp", convert_then_tp), ("sequence_parallel", sequence_parallel)):
        try:
            built = case()
            m, loss = built if isinstance(built, tuple) else (built, train(built))
            results += _compare(f"2d {name}", m, loss, *ref, tol)
            report = getattr(m, "opsadv_report", None)
            if report is not None and not any(c.kind == "fused" and "ForCausalLMLoss" in c.what
                                              for c in report.changes):
                results.append(f"2d {name}: the loss was not fused (lm_loss): {report}")
        except Exception:                     # noqa: BLE001 - one case's failure must not hide the others'
            results.append(f"2d {name}: {traceback.format_exc()[-1500:]}")
        dist.barrier()
    try:
        results += _vocab_parallel_op_2d(mesh)
    except Exception:                         # noqa: BLE001
        results.append(f"2d vocab-parallel op: {traceback.format_exc()[-1500:]}")
    return results


def _vocab_parallel_op_2d(mesh) -> list[str]:
    """linear_cross_entropy with the weight's vocabulary split over "tp" and the tokens over "dp" (float64, odd
    sizes): loss and gradients equal the unsplit call's; 'sum' is Partial() over dp, 'mean' there is refused."""
    import opsadv
    from opsadv.errors import ShardingError
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    torch.manual_seed(1234)                   # the same tensors on every rank
    f64 = torch.float64
    h, w, b = torch.randn(2, 19, 16, dtype=f64), torch.randn(29, 16, dtype=f64), torch.randn(29, dtype=f64)
    labels = torch.randint(0, 29, (2, 19))
    labels[:, ::4] = -100
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0)
    fails = []
    for reduction, want_p in (("sum", (Partial(), Replicate())), ("none", (Shard(1), Replicate()))):
        hp, wp, bp = (t.clone().requires_grad_() for t in (h, w, b))
        ref = opsadv.ops.linear_cross_entropy(hp, wp, labels, bias=bp, reduction=reduction, **kw)
        g = torch.randn_like(ref)
        ref.backward(g)
        hd = distribute_tensor(h, mesh, [Shard(1), Replicate()]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Replicate(), Shard(0)]).requires_grad_()
        bd = distribute_tensor(b, mesh, [Replicate(), Shard(0)]).requires_grad_()
        ld = distribute_tensor(labels, mesh, [Shard(1), Replicate()])
        got = opsadv.ops.linear_cross_entropy(hd, wd, ld, bias=bd, reduction=reduction, **kw)
        if tuple(got.placements) != want_p:
            fails.append(f"2d op {reduction}: loss placements {got.placements}, expected {want_p}")
        got.full_tensor().backward(g)
        for n, a, e in (("loss", got, ref), ("grad hidden", hd.grad, hp.grad), ("grad weight", wd.grad, wp.grad),
                        ("grad bias", bd.grad, bp.grad)):
            a = a.full_tensor() if isinstance(a, DTensor) else a
            err = (a - e).abs().max().item()
            if not err <= 1e-10:
                fails.append(f"2d op {reduction}: {n} max err {err:.3g}")
    try:
        opsadv.ops.linear_cross_entropy(distribute_tensor(h, mesh, [Shard(1), Replicate()]),
                                        distribute_tensor(w, mesh, [Replicate(), Shard(0)]),
                                        distribute_tensor(labels, mesh, [Shard(1), Replicate()]))
        fails.append("2d op: reduction='mean' over tokens split on dp was accepted")
    except ShardingError as e:
        if "argument 'reduction'" not in str(e):
            fails.append(f"2d op: unclear refusal: {e}")
    return fails


def _worker(rank, port, seed, out_dir, world=WORLD, cases="_cases"):
    torch.set_num_threads(1)
    os.environ["OPSADV_CONVERT_FLOOR"] = "0"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import opsadv
        opsadv.use_backend("reference")
        results = globals()[cases](rank, seed, os.path.join(out_dir, "ckpt"))
    except Exception:                         # noqa: BLE001
        results = [f"worker: {traceback.format_exc()[-2000:]}"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, world, cases):
    import torch.multiprocessing as mp
    seed = random.randrange(1 << 30)           # fresh inputs and weights each run; the seed is in the message
    mp.spawn(_worker, args=(_free_port(), seed, str(tmp_path), world, cases), nprocs=world, join=True)
    failures = []
    for r in range(world):
        failures += [f"rank {r}: {msg}" for msg in json.loads((tmp_path / f"rank{r}.json").read_text())]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


def test_converted_llama_trains_under_tp_fsdp2_and_ddp(tmp_path):
    _spawn(tmp_path, WORLD, "_cases")


def test_converted_llama_trains_on_a_2d_mesh_tp_x_fsdp2(tmp_path):
    _spawn(tmp_path, DP * TP, "_cases_2d")
