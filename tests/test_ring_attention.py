"""opsadv.distributed.ring_attention on gloo (CPU, reference backend, float64) against single-process attention on
the full sequence: 4 ranks, and 2 (two pairs at once), causal and not, zig-zag and contiguous shares, GQA, odd
lengths (37, 101), out, lse and dq / dk / dv; sliding windows against sparse_attention's; a subgroup with
non-contiguous global ranks; inputs that every rank must refuse with the same error.  One spawn runs all the cases
(a spawn costs seconds); each rank writes the failures it saw, the test asserts there are none.  Single-process
parts: the zig-zag helpers, the lse merge of empty rows, the ring's causal steps doing even work, the step code on
the Triton kernels (interpreter), the bench suite's cases."""
from __future__ import annotations

import json
import os
import socket
import traceback
from datetime import timedelta

import pytest
import torch

from opsadv.distributed import zigzag_shard, zigzag_unshard
from opsadv.distributed.lse_merge import empty_accumulators, merge_into
from opsadv.distributed.ring_layout import RingLayout
from opsadv.distributed.ring_steps import step_block
from opsadv.errors import InvalidArgumentError

pytestmark = pytest.mark.xdist_group("ring_attention")
TOL = 1e-10
OP = "opsadv.distributed.ring_attention"


# ---- the worker (one process per rank) ------------------------------------------------------------------------
def _share(x, rank, world, zigzag):
    return zigzag_shard(x, rank, world) if zigzag else torch.tensor_split(x, world, dim=2)[rank]


def _inputs(n, hq, hkv, seed, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(2, hq, n, d, generator=g, dtype=torch.float64)


def _full(q, k, v, do, causal, window):
    """(out, lse, dq, dk, dv) of single-process attention over the whole sequence."""
    from opsadv.ops.flash_attention import flash_attention
    from opsadv.ops.sparse_attention import sparse_attention
    from opsadv import SparseLayout
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if window is None:
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    else:
        out, lse = sparse_attention(q, k, v, SparseLayout.sliding_window(q.shape[2], window, causal=True),
                                    return_lse=True)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), do))


def _check(fails, name, rank, world, n, hq, hkv, causal, zigzag, window=None, group=None, seed=0, seq_len=None):
    from opsadv.distributed import ring_attention
    q, k, v, do = _inputs(n, hq, hkv, seed)
    want = _full(q, k, v, do, causal, window)
    ql, kl, vl = (_share(t, rank, world, zigzag).requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, causal=causal, load_balance=zigzag, window=window, group=group,
                              seq_len=seq_len, return_lse=True)
    got = (out, lse, *torch.autograd.grad(out, (ql, kl, vl), _share(do, rank, world, zigzag)))
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        err = (a - _share(b, rank, world, zigzag)).abs().max().item()
        if not err <= TOL:
            fails.append(f"{name} rank {rank}: {what} max error {err:.3g}")


def _expect_error(fails, name, rank, fn, *needles):
    try:
        fn()
    except InvalidArgumentError as e:
        msg = str(e)
        if not msg.startswith(OP) or not all(s in msg for s in needles):
            fails.append(f"{name} rank {rank}: message {msg!r} lacks one of {needles}")
        return
    except Exception as e:  # noqa: BLE001 - any other exception is the failure reported
        fails.append(f"{name} rank {rank}: raised {type(e).__name__}: {e}")
        return
    fails.append(f"{name} rank {rank}: no error")


def _cases(fails, rank, world, group, tag):
    """Every case on `group` (world ranks, this one `rank` in it); failures named with `tag`."""
    from opsadv.distributed import ring_attention

    def check(name, *args, **kw):
        _check(fails, f"{tag} {name}", rank, world, *args, group=group, **kw)

    def refused(name, fn, *needles):
        _expect_error(fails, f"{tag} {name}", rank, fn, *needles)

    for n in (37, 101):
        for zigzag in (False, True):
            for causal in (False, True):
                hkv = 2 if causal else 4          # GQA on the causal cases
                check(f"n{n} zigzag={zigzag} causal={causal} h4/{hkv}", n, 4, hkv, causal, zigzag, seed=n)
    for zigzag in (False, True):
        shortest = RingLayout(37, world, zigzag).chunk_len(2 * world - 2 if zigzag else world - 2)
        for w in (0, 3, shortest):
            check(f"window {w} zigzag={zigzag}", 37, 4, 2, True, zigzag, window=w, seed=w)
    check("seq_len given", 37, 2, 2, True, True, seq_len=37)

    # bad inputs: every rank raises, none hangs; the group works afterwards
    q, k, v, _ = _inputs(37, 2, 2, 0)
    ql, kl, vl = (_share(t, rank, world, True) for t in (q, k, v))
    longer = (1 if rank == 0 else -1 if rank == world - 1 else 0)
    qb, kb, vb = (_share(t, rank, world, True)[:, :, :ql.shape[2] + longer] if longer <= 0
                  else torch.cat((_share(t, rank, world, True), t[:, :, :1]), dim=2) for t in (q, k, v))
    refused("shares not zigzag_shard's", lambda: ring_attention(qb, kb, vb, causal=True, group=group),
            "argument 'q'", "tokens by rank", "zigzag_shard")
    qh = ql.repeat(1, 2, 1, 1) if rank == 1 else ql
    refused("heads differ across ranks", lambda: ring_attention(qh, kl, vl, group=group), "q heads", "rank 1")
    kbad = kl[:, :1].repeat(1, 3, 1, 1) if rank == 0 else kl           # 3 kv heads do not divide 2
    refused("one rank's k refused", lambda: ring_attention(ql, kbad, kbad, group=group),
            "dividing q's 2" if rank == 0 else "rank(s) [0] refused")
    refused("window wider than a chunk", lambda: ring_attention(ql, kl, vl, causal=True, window=10, group=group),
            "argument 'window'", "shortest chunk")
    refused("window without causal", lambda: ring_attention(ql, kl, vl, window=2, group=group),
            "argument 'window'", "causal=True")
    refused("wrong seq_len", lambda: ring_attention(ql, kl, vl, seq_len=37 + 2 * world, group=group),
            "argument 'q'", "tokens by rank")
    refused("too short for zig-zag", lambda: ring_attention(ql[:, :, :1], kl[:, :, :1], vl[:, :, :1], group=group),
            f"at least {2 * world} tokens")
    check("after the errors", 37, 2, 2, True, True)


def _worker(rank, world, port, out_dir):
    """4 ranks: every case on the whole group, then on the pairs {0, 1} and {2, 3} at once (2-rank rings), on
    {1, 3} (a subgroup whose global ranks are not its ranks) and on one-rank groups."""
    import torch.distributed as dist
    import opsadv
    torch.set_num_threads(1)
    fails = []
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))   # a hang fails the run instead of stalling CI
    try:
        # every rank creates every group, in the same order (new_group is collective over the default group)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        odd = dist.new_group([1, 3])
        singles = [dist.new_group([r]) for r in range(world)]
        with opsadv.use_backend("reference"):
            _cases(fails, rank, world, None, f"W{world}")
            _cases(fails, rank % 2, 2, pairs[rank // 2], f"W2 pair {rank // 2}")
            if rank in (1, 3):
                _check(fails, "subgroup [1, 3]", rank // 2, 2, 37, 4, 2, True, True, group=odd)
            _check(fails, "one-rank group", 0, 1, 37, 4, 2, True, True, group=singles[rank])
    except Exception:  # noqa: BLE001 - reported as this rank's failure
        fails.append(f"rank {rank}: {traceback.format_exc()}")
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(fails, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ring_attention_matches_full_attention(tmp_path):
    import torch.multiprocessing as mp
    world = 4
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world)
    fails = [f for r in range(world) for f in json.loads((tmp_path / f"rank{r}.json").read_text())]
    assert not fails, "\n".join(fails)


# ---- single process -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, world", [(37, 2), (101, 4), (8, 4)])
def test_zigzag_shard_round_trip_and_layout(n, world):
    x = torch.arange(n).view(1, 1, n, 1)
    shards = [zigzag_shard(x, r, world) for r in range(world)]
    layout = RingLayout(n, world, True)
    assert [s.shape[2] for s in shards] == [layout.local_len(r) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards), x)
    for r, s in enumerate(shards):
        a, b = layout.chunks_of(r)
        want = [*range(layout.chunk_start(a), layout.chunk_start(a) + layout.chunk_len(a)),
                *range(layout.chunk_start(b), layout.chunk_start(b) + layout.chunk_len(b))]
        assert s.flatten().tolist() == want
    with pytest.raises(InvalidArgumentError, match="zigzag_shard: argument 'x' must be at least"):
        zigzag_shard(torch.zeros(1, 1, 2 * world - 1, 1), 0, world)
    if n % (2 * world) not in (0, 2 * world - 1):        # one token more on rank 0 changes the split
        with pytest.raises(InvalidArgumentError, match="zigzag_unshard: argument 'shards\\[0\\]'"):
            zigzag_unshard([torch.cat((shards[0], shards[0][:, :, :1]), dim=2), *shards[1:]])


def test_merge_keeps_rows_without_keys_finite():
    q = torch.zeros(1, 1, 3, 2, dtype=torch.float64)
    acc_out, acc_lse = empty_accumulators(q)
    ninf = float("-inf")
    merge_into(acc_out, acc_lse, torch.zeros(1, 1, 3, 2, dtype=torch.float64), torch.tensor([[[ninf, 0.0, ninf]]]))
    merge_into(acc_out, acc_lse, torch.ones(1, 1, 3, 2, dtype=torch.float64), torch.tensor([[[ninf, 0.0, 1.0]]]))
    assert not acc_out.isnan().any()
    assert acc_lse[0, 0, 0] == ninf and acc_out[0, 0, 0].eq(0).all()                     # no key anywhere
    assert torch.allclose(acc_out[0, 0, 1], torch.full((2,), 0.5, dtype=torch.float64))  # equal weights
    assert torch.allclose(acc_lse[0, 0, 1], torch.tensor(2.0, dtype=torch.float64).log())
    assert acc_out[0, 0, 2].eq(1).all() and acc_lse[0, 0, 2] == 1.0


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_causal_steps_do_even_work(world):
    """Score elements each rank computes over the causal ring (a diagonal step counted as its causal half):
    zig-zag shares make them equal up to the rounding of uneven chunks; contiguous ones do not."""
    def work(layout, rank):
        total = 0
        for src in range(world):
            block = step_block(layout, rank, src, True)
            if block is None:
                continue
            rows, cols, diag = block
            nq = len(range(layout.local_len(rank))[rows])
            nk = len(range(layout.local_len(src))[cols])
            total += nq * (nk + 1) // 2 if diag else nq * nk
        return total
    zz = [work(RingLayout(64 * world, world, True), r) for r in range(world)]
    assert max(zz) - min(zz) <= 64 * world, zz
    flat = [work(RingLayout(64 * world, world, False), r) for r in range(world)]
    assert max(flat) > 1.5 * min(flat)


def test_bench_suite_ring_runs_on_the_cpu(tmp_path, monkeypatch):
    """`opsadv bench --suite ring`'s cases build and run end to end (tiny chunks here; the GPU grid is 4k-16k), the
    ring step agreeing with single-GPU flash_attention: out forward, dk / dv backward; the merge alone agreeing with
    the torch formula."""
    from opsadv.bench import runner, suite_ring
    monkeypatch.setattr(runner, "ROUNDS", 1)
    monkeypatch.setattr(suite_ring, "CPU_QUICK", [(24, 2, 16, step, bwd) for bwd in (False, True)
                                                  for step in suite_ring.STEPS] + [(24, 2, 16, "merge", False)])
    assert not runner.run_bench(["ring"], True, str(tmp_path / "r.json"), None, autotune=False)
    rows = json.loads((tmp_path / "r.json").read_text())["cases"]
    assert [r["case"].split()[0] for r in rows] == ["fwd", "fwd", "bwd", "bwd", "merge"]
    assert all(r["rel_err"] < 1e-2 and r["baseline"] == "flash_attention" for r in rows[:4])
    assert rows[0]["case"] == "fwd bf16 b1 h2 chunk24 d16 diagonal step"
    assert set(rows[0]["peers"]) == {"flash_attention", "flash_attention_lse", "step_torch_merge"}
    assert rows[4]["case"] == "merge bf16 b1 h2 chunk24 d16" and rows[4]["baseline"] == "torch_merge"
    assert rows[4]["rel_err"] < 1e-5 and set(rows[4]["peers"]) == {"torch_merge"}
    assert suite_ring.flops(4096, 32, 128, True, False) == 2 * 4096 * 4096 * 32 * 128
    assert suite_ring.merge_bytes(4096, 32, 128) == 32 * 4096 * (128 * 10 + 12)
    grid = suite_ring._grid(False)                                          # the GPU grid
    assert {(c, h, d) for c, h, d, _, _ in grid} == {(c, 32, 128) for c in (4096, 8192, 16384)} and len(grid) == 15
    assert [c for c, _, _, step, _ in grid if step == "merge"] == [4096, 8192, 16384]


def test_ring_steps_on_the_triton_kernels():
    """The ring's step code on the cuda backend's Triton kernels (the interpreter here): a past chunk in full and
    the own chunk causal over row / column slices of q and the stacked K/V, GQA, fp16, merged by lse (the Triton
    attention_merge_ into a row slice of the accumulators); then the backward steps with the merged out and lse.  Against the reference with the equivalent mask."""
    import opsadv
    from opsadv.distributed.ring_steps import ALL, add_kv_grads, backward_step, forward_step
    from opsadv.ops.flash_attention import flash_attention
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, h, 40, 32, generator=g).half() for h in (4, 2, 2, 4))
    kv, scale = torch.stack((k, v)), 32 ** -0.5
    steps = ((ALL, slice(0, 24), False), (slice(24, None), slice(24, None), True))
    i, j = torch.arange(40)[:, None], torch.arange(40)[None]
    mask = (j < 24) | ((i >= 24) & (j <= i))
    leaves = tuple(t.float().requires_grad_() for t in (q, k, v))
    with opsadv.use_backend("reference"):
        want, want_lse = flash_attention(*leaves, attn_mask=mask, return_lse=True)
        grads = torch.autograd.grad(want, leaves, do.float())
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        acc_out, acc_lse = empty_accumulators(q)
        for step in steps:
            forward_step(q, kv, step, scale, acc_out, acc_lse)
        dq, dkv = torch.zeros(q.shape), torch.zeros(kv.shape)
        for step in steps:
            add_kv_grads(dkv, step, *backward_step(do, q, kv, acc_out.half(), acc_lse, step, scale, dq))
    assert t.counts == {"cuda.triton.flash_attention": 4, "cuda.triton.attention_merge_": 2}, str(t)
    assert (acc_out - want).abs().max() < 2e-3 and (acc_lse - want_lse).abs().max() < 1e-4
    for got, ref in zip((dq, dkv[0], dkv[1]), grads):
        assert (got - ref).abs().max() < 3e-3
