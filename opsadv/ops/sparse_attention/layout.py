"""SparseLayout: the core-owned description of a block-sparse attention pattern and/or a
packed variable-length batch.  Backends read its explicit parts (window, globals, causal,
padding, cu_seqlens) to map onto their own kernels (e.g. Ascend's sparse_mode band with
pre/next tokens = window, TND layout = cu_seqlens); the reference backend turns it into a
dense boolean mask (`dense_mask`), which *defines* its semantics:

    allowed(b, h, i, j) = causal_ok(i, j) and key_ok(b, j) and same_segment(i, j)
                          and (block_mask[b, h, i // bs, j // bs] or window_ok(i, j) or global_ok(i, j))

with i' = i + (s_k - s_q) (bottom-right alignment):
    causal_ok   j <= i'                                 (when causal)
    window_ok   i' - left <= j <= i' + right            (when a window is set)
    global_ok   i < G or j < G                          (G = num_global; per segment when packed)
    key_ok      key_padding_mask[b, j]                  (True = a real token)
    same_segment  i and j in the same cu_seqlens segment (packed batches; batch must be 1)
A row with no allowed key yields zeros (and lse = -inf).

Terms combine as: block_mask / window / globals say which pairs MAY attend (their union);
causal, key padding and segments RESTRICT (their intersection).  `combine(other)` intersects
(a sliding window over the real tokens only: `window.combine(padding)`), `combine(other, "or")`
unites the patterns.

Constructors are cheap, vectorized and cached on their (hashable) parameters, so calling one
per layer returns the same object, whose kernel metadata (`tile_index`) is then computed once.

Two host-side facts travel with a layout so that kernels need no device read (CUDA graphs):
`dense_blocks` (the block mask is all True) and `max_seqlen` (a bound on the packed segments'
lengths).  Constructors set them where they know them; `with_` / `combine` re-derive them, so a
modified layout never keeps a stale one; they are verified whenever the tensors can be read."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.sparse_tiles import TileIndex, capturing, tile_index

OP = "sparse_attention"


def _dev(device) -> torch.device:
    return torch.device(device if device is not None else "cpu")


def _nblocks(n: int, bs: int) -> int:
    return -(-n // bs)


def _readable(t: Tensor) -> bool:
    """t's values can be read on the host now: not while a CUDA graph is captured or dynamo traces (a layout built
    in a compiled graph takes its facts from the code that built it)."""
    return not capturing(t) and not torch.compiler.is_compiling()


def _check_int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidArgumentError(OP, name, f"an int >= {lo}", repr(v))
    return v


@dataclass(frozen=True, eq=False)
class SparseLayout:
    seq_q: int
    seq_k: int
    block_size: int
    block_mask: Tensor                      # bool (B|1, H|1, ceil(s_q/bs), ceil(s_k/bs)): explicit blocks
    causal: bool = False
    window: tuple[int, int] | None = None   # (left, right) in tokens
    num_global: int = 0
    key_padding_mask: Tensor | None = None  # bool (B, s_k), True = real token
    cu_seqlens: Tensor | None = None        # int32 (n_seq + 1,), packed batch (s_q == s_k)
    # Host-side facts kernels need without reading the device (CUDA-graph capture), kept by the
    # constructors that know them; a layout built by hand has them off unless it says otherwise.
    dense_blocks: bool = False              # block_mask is known to be all True
    max_seqlen: int | None = None           # an upper bound on the packed segments' lengths (with cu_seqlens)

    def __post_init__(self):
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise InvalidArgumentError(OP, "layout.block_size", "an int >= 1", repr(bs))
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (self.seq_q, self.seq_k)) \
                or self.seq_q < 0 or self.seq_k < 0:      # 0: an empty sequence (sparse_attention returns empties)
            raise InvalidArgumentError(OP, "layout.seq_q/seq_k", "int lengths >= 0", (self.seq_q, self.seq_k))
        nq, nk = _nblocks(self.seq_q, bs), _nblocks(self.seq_k, bs)
        bm = self.block_mask
        if not isinstance(bm, Tensor) or bm.dtype != torch.bool or bm.dim() != 4 or tuple(bm.shape[2:]) != (nq, nk):
            raise InvalidArgumentError(OP, "layout.block_mask", f"a bool tensor (B|1, H|1, {nq}, {nk})",
                                       f"{getattr(bm, 'dtype', type(bm).__name__)} {tuple(getattr(bm, 'shape', ()))}")
        if not isinstance(self.causal, bool):
            raise InvalidArgumentError(OP, "layout.causal", "a bool", repr(self.causal))
        if self.window is not None:
            w = self.window
            if not isinstance(w, tuple) or len(w) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                   for x in w) or w[0] < 0 or w[1] < 0:
                raise InvalidArgumentError(OP, "layout.window", "None or (left, right) ints, both >= 0", repr(w))
        _check_int("layout.num_global", self.num_global)
        if self.key_padding_mask is not None:
            kp = self.key_padding_mask
            if not isinstance(kp, Tensor) or kp.dtype != torch.bool or kp.dim() != 2 or kp.shape[1] != self.seq_k:
                raise InvalidArgumentError(OP, "layout.key_padding_mask", f"a bool tensor (B, {self.seq_k})",
                                           f"{getattr(kp, 'dtype', type(kp).__name__)} {tuple(getattr(kp, 'shape', ()))}")
            if kp.device != bm.device:
                raise InvalidArgumentError(OP, "layout.key_padding_mask", f"on the block mask's device {bm.device}",
                                           str(kp.device))
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if self.seq_q != self.seq_k:
                raise InvalidArgumentError(OP, "layout.cu_seqlens", "a packed batch with s_q == s_k", (self.seq_q, self.seq_k))
            # values are checked on the host, except while a CUDA graph is captured (no sync allowed there)
            if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) \
                    or cu.numel() < 2 or (_readable(cu) and (int(cu[0]) != 0 or int(cu[-1]) != self.seq_q
                                                                 or bool((cu[1:] < cu[:-1]).any()))):
                raise InvalidArgumentError(OP, "layout.cu_seqlens",
                                           f"int cumulative lengths from 0 to {self.seq_q}, non-decreasing",
                                           cu.tolist() if isinstance(cu, Tensor) else repr(cu))
            if cu.device != bm.device:
                raise InvalidArgumentError(OP, "layout.cu_seqlens", f"on the block mask's device {bm.device}", str(cu.device))
        self._check_facts()

    def _check_facts(self) -> None:
        """dense_blocks / max_seqlen are trusted by kernels (a wrong one gives wrong results), so they
        are verified against the tensors whenever those can be read (not during graph capture)."""
        if not isinstance(self.dense_blocks, bool):
            raise InvalidArgumentError(OP, "layout.dense_blocks", "a bool", repr(self.dense_blocks))
        if self.dense_blocks and _readable(self.block_mask) and not bool(self.block_mask.all()):
            raise InvalidArgumentError(OP, "layout.dense_blocks", "True only for an all-True block mask",
                                       f"a block mask with {int((~self.block_mask).sum())} False blocks")
        ms, cu = self.max_seqlen, self.cu_seqlens
        if ms is None:
            return
        if cu is None:
            raise InvalidArgumentError(OP, "layout.max_seqlen", "None without cu_seqlens (it bounds packed segments)",
                                       repr(ms))
        _check_int("layout.max_seqlen", ms)
        if _readable(cu):
            longest = int((cu[1:] - cu[:-1]).max())
            if ms < longest:
                raise InvalidArgumentError(OP, "layout.max_seqlen", f">= the longest segment ({longest})", ms)

    # ---- views ------------------------------------------------------------------------------------
    @property
    def window_left(self) -> int:
        return -1 if self.window is None else self.window[0]

    @property
    def window_right(self) -> int:
        return -1 if self.window is None else self.window[1]

    @property
    def device(self) -> torch.device:
        return self.block_mask.device

    @property
    def seqlens(self) -> list[int] | None:
        """Lengths of the packed sequences (None when not packed)."""
        return None if self.cu_seqlens is None else (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def __repr__(self) -> str:
        parts = [f"s_q={self.seq_q}", f"s_k={self.seq_k}", f"block_size={self.block_size}",
                 f"block_mask={tuple(self.block_mask.shape)} ({self.block_mask.float().mean().item():.0%} set)"]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.num_global:
            parts.append(f"num_global={self.num_global}")
        if self.key_padding_mask is not None:
            parts.append(f"key_padding_mask={tuple(self.key_padding_mask.shape)}")
        if self.cu_seqlens is not None:
            parts.append(f"packed={self.cu_seqlens.numel() - 1} seqs"
                         + ("" if self.max_seqlen is None else f" (<= {self.max_seqlen} tokens)"))
        return f"SparseLayout({', '.join(parts)})"

    def dense_mask(self, batch: int = 1, heads: int = 1, device=None) -> Tensor:
        """The exact element mask (B|1, H|1, s_q, s_k), built naively: the semantics' oracle."""
        return dense_mask(self.seq_q, self.seq_k, self.block_size, self.block_mask, self.causal, self.window,
                          self.num_global, self.key_padding_mask, self.cu_seqlens, device=device)

    def density(self) -> float:
        """Fraction of (query, key) pairs allowed, averaged over batch and heads (exact, dense: small layouts)."""
        return self.dense_mask().float().mean().item()

    def to(self, device) -> "SparseLayout":
        d = _dev(device)
        mv = lambda t: None if t is None else t.to(d)  # noqa: E731
        return dataclasses.replace(self, block_mask=self.block_mask.to(d), key_padding_mask=mv(self.key_padding_mask),
                                   cu_seqlens=mv(self.cu_seqlens))

    def with_(self, **changes) -> "SparseLayout":
        """A copy with some fields replaced (validated), e.g. `.with_(key_padding_mask=m)`."""
        bad = set(changes) - {f.name for f in dataclasses.fields(self)}
        if bad:
            raise InvalidArgumentError(OP, "with_", "field names of SparseLayout", sorted(bad))
        # facts about a replaced tensor are re-derived (when readable now) unless given: never stale
        if "block_mask" in changes and "dense_blocks" not in changes:
            changes["dense_blocks"] = _all_true(changes["block_mask"])
        if "cu_seqlens" in changes and "max_seqlen" not in changes:
            changes["max_seqlen"] = _longest(changes["cu_seqlens"])
        return dataclasses.replace(self, **changes)

    def combine(self, other: "SparseLayout", how: str = "and") -> "SparseLayout":
        """Combine two layouts of the same lengths.
        how="and" (default): pairs allowed by both, e.g. `sliding_window(...).combine(from_padding_mask(m))`
            or a window over a packed batch.  One side must allow every pair before its restrictions
            (block mask all True: dense, key padding, plain varlen layouts), since a general
            intersection of two patterns is not a block mask + window + globals.  Global tokens of a
            packed result count per sequence.
        how="or": union of the allowing terms (block masks, windows, globals; bands containing the
            diagonal unite into one band), intersection of the restrictions (causal, padding, segments).
        Block sizes must divide one another; the result takes the smaller."""
        if not isinstance(other, SparseLayout):
            raise InvalidArgumentError(OP, "combine(other)", "a SparseLayout", type(other).__name__)
        if how not in ("and", "or"):
            raise InvalidArgumentError(OP, "combine(how)", "'and' or 'or'", repr(how))
        if (self.seq_q, self.seq_k) != (other.seq_q, other.seq_k):
            raise InvalidArgumentError(OP, "combine(other)", f"lengths (s_q, s_k) = {(self.seq_q, self.seq_k)}",
                                       (other.seq_q, other.seq_k))
        if other.device != self.device:
            raise InvalidArgumentError(OP, "combine(other)", f"a layout on {self.device}", str(other.device))
        bs = min(self.block_size, other.block_size)
        if max(self.block_size, other.block_size) % bs:
            raise InvalidArgumentError(OP, "combine(other)", f"a block size dividing or divided by {self.block_size}",
                                       other.block_size)
        refine = lambda l: _refine(l.block_mask, l.block_size, bs, self.seq_q, self.seq_k)  # noqa: E731
        if how == "or":
            bm = refine(self) | refine(other)
            if self.window is None or other.window is None:
                window = self.window or other.window
            else:   # both bands contain the diagonal, so their union is one band
                window = (max(self.window[0], other.window[0]), max(self.window[1], other.window[1]))
            ng = max(self.num_global, other.num_global)
        else:
            if self.dense_blocks or bool(self.block_mask.all()):
                pattern = other
            elif other.dense_blocks or bool(other.block_mask.all()):
                pattern = self
            else:
                raise InvalidArgumentError(OP, "combine(other, how='and')",
                                           "one layout whose block mask allows every block (dense / padding / varlen)",
                                           f"{self!r} and {other!r}")
            bm, window, ng = refine(pattern), pattern.window, pattern.num_global
        # all True after "or" if either side is; after "and" the result's blocks are the pattern's
        dense = (self.dense_blocks or other.dense_blocks) if how == "or" else pattern.dense_blocks
        kpm = _and_opt(self.key_padding_mask, other.key_padding_mask)
        cu = self.cu_seqlens if other.cu_seqlens is None else other.cu_seqlens
        if self.cu_seqlens is not None and other.cu_seqlens is not None \
                and not torch.equal(self.cu_seqlens.long(), other.cu_seqlens.long()):
            raise InvalidArgumentError(OP, "combine(other)", "the same cu_seqlens (or none)", other.cu_seqlens.tolist())
        bounds = [x.max_seqlen for x in (self, other) if x.max_seqlen is not None]
        return SparseLayout(self.seq_q, self.seq_k, bs, bm.contiguous(), self.causal or other.causal, window, ng, kpm, cu,
                            dense, min(bounds) if bounds and cu is not None else None)

    # ---- constructors -----------------------------------------------------------------------------
    @classmethod
    def dense(cls, seq_q: int, seq_k: int | None = None, *, causal: bool = False, block_size: int = 128,
              device=None) -> "SparseLayout":
        """Every pair allowed (then restricted by causal)."""
        return _dense(seq_q, seq_q if seq_k is None else seq_k, causal, block_size, _dev(device))

    @classmethod
    def sliding_window(cls, seq_q: int, window: int | tuple[int, int], *, seq_k: int | None = None,
                       causal: bool = True, num_global: int = 0, block_size: int = 128, device=None) -> "SparseLayout":
        """Each query i sees keys within `window` tokens: i' - w <= j <= i' (causal) or |i' - j| <= w;
        `window` may be (left, right).  Optional `num_global` tokens (Longformer)."""
        if isinstance(window, int) and not isinstance(window, bool):
            _check_int("window", window)
            window = (window, 0 if causal else window)
        elif isinstance(window, (tuple, list)) and len(window) == 2:
            window = (_check_int("window[0]", window[0]), _check_int("window[1]", window[1]))
        else:
            raise InvalidArgumentError(OP, "window", "an int >= 0 or (left, right)", repr(window))
        return _window(seq_q, seq_q if seq_k is None else seq_k, window, causal, num_global, block_size, _dev(device))

    @classmethod
    def global_tokens(cls, seq: int, num_global: int, *, window: int | tuple[int, int] | None = None,
                      causal: bool = False, block_size: int = 128, device=None) -> "SparseLayout":
        """The first `num_global` tokens attend to and are attended by all; with `window`, a
        sliding window for everyone else (Longformer)."""
        _check_int("num_global", num_global)
        if num_global > seq:
            raise InvalidArgumentError(OP, "num_global", f"<= seq ({seq})", num_global)
        if window is None:
            return _window(seq, seq, None, causal, num_global, block_size, _dev(device))
        return cls.sliding_window(seq, window, causal=causal, num_global=num_global, block_size=block_size, device=device)

    @classmethod
    def dilated(cls, seq: int, *, block_size: int, dilation: int, num_blocks: int | None = None,
                local_blocks: int = 1, causal: bool = False, device=None) -> "SparseLayout":
        """Block-level dilated / strided pattern (Sparse Transformer): query block p sees key block
        q when |p - q| < local_blocks, or (p - q) % dilation == 0 and |p - q| <= num_blocks * dilation
        (num_blocks None: unbounded).  `causal` also masks elements above the diagonal."""
        _check_int("dilation", dilation, 1)
        _check_int("local_blocks", local_blocks)
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks)
        return _dilated(seq, block_size, dilation, num_blocks, local_blocks, causal, _dev(device))

    @classmethod
    def bigbird(cls, seq: int, *, block_size: int = 64, window_blocks: int = 3, global_blocks: int = 1,
                random_blocks: int = 2, heads: int = 1, seed: int = 0, causal: bool = False,
                device=None) -> "SparseLayout":
        """BigBird: a block-aligned band of `window_blocks` blocks (centred), the first
        `global_blocks` blocks global (num_global = global_blocks * block_size tokens), and
        `random_blocks` seeded random key blocks per query block (per head when heads > 1)."""
        for n, v in (("window_blocks", window_blocks), ("global_blocks", global_blocks),
                     ("random_blocks", random_blocks), ("seed", seed)):
            _check_int(n, v)
        _check_int("heads", heads, 1)
        return _bigbird(seq, block_size, window_blocks, global_blocks, random_blocks, heads, seed, causal, _dev(device))

    @classmethod
    def from_block_mask(cls, block_mask: Tensor, *, block_size: int, seq_q: int | None = None,
                        seq_k: int | None = None, causal: bool = False) -> "SparseLayout":
        """An arbitrary boolean block mask (nq, nk), (H, nq, nk) or (B|1, H|1, nq, nk)."""
        if not isinstance(block_mask, Tensor) or block_mask.dtype != torch.bool or not 2 <= block_mask.dim() <= 4:
            raise InvalidArgumentError(OP, "block_mask", "a bool tensor of rank 2..4",
                                       f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
        bm = block_mask
        while bm.dim() < 4:
            bm = bm.unsqueeze(0)
        _check_int("block_size", block_size, 1)
        sq = seq_q if seq_q is not None else bm.shape[2] * block_size
        sk = seq_k if seq_k is not None else bm.shape[3] * block_size
        return cls(sq, sk, block_size, bm.contiguous(), causal, dense_blocks=_all_true(bm))

    @classmethod
    def key_padding(cls, key_padding_mask: Tensor, *, seq_q: int | None = None, causal: bool = False,
                    block_size: int = 128) -> "SparseLayout":
        """Dense attention over the real keys only (`key_padding_mask` (B, s_k) bool, True = real)."""
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dim() != 2:
            raise InvalidArgumentError(OP, "key_padding_mask", "a (B, s_k) tensor", repr(key_padding_mask))
        kpm = key_padding_mask.to(torch.bool)
        sk = kpm.shape[1]
        sq = sk if seq_q is None else seq_q
        # cached on the mask's content, so a model's layers (and steps) share one layout and its tile index
        key = (str(kpm.device), tuple(kpm.shape), sq, causal, block_size, kpm.cpu().numpy().tobytes())
        hit = _padding_cache.get(key)
        if hit is not None:
            return hit
        base = _dense(sq, sk, causal, block_size, kpm.device)
        with torch.inference_mode(False):         # cached: usable by later training calls too (_normal_tensors)
            lay = dataclasses.replace(base, key_padding_mask=kpm.clone().contiguous())
        if len(_padding_cache) >= 64:
            _padding_cache.pop(next(iter(_padding_cache)))
        _padding_cache[key] = lay
        return lay

    @classmethod
    def from_padding_mask(cls, attention_mask: Tensor, *, causal: bool = False, block_size: int = 128) -> "SparseLayout":
        """HF-style (b, s) attention mask (1 = token, 0 = padding, any int/bool dtype) -> key padding layout."""
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
            raise InvalidArgumentError(OP, "attention_mask", "a (batch, seq) tensor of 1/0",
                                       tuple(getattr(attention_mask, "shape", ())))
        return cls.key_padding(attention_mask != 0, causal=causal, block_size=block_size)

    @classmethod
    def varlen(cls, seqlens: Sequence[int] | Tensor, *, causal: bool = False,
               window: int | tuple[int, int] | None = None, num_global: int = 0, block_size: int = 128,
               device=None) -> "SparseLayout":
        """A packed batch (1, h, sum(seqlens), d): each sequence attends within itself
        (optionally causal / windowed / with per-sequence global tokens)."""
        if isinstance(seqlens, Tensor):
            device = seqlens.device if device is None else device
            seqlens = seqlens.tolist()
        seqlens = tuple(seqlens)
        for n in seqlens:
            _check_int("seqlens[i]", n)
        if not seqlens or sum(seqlens) < 1:
            raise InvalidArgumentError(OP, "seqlens", "at least one token", list(seqlens))
        if window is not None:
            if isinstance(window, int) and not isinstance(window, bool):
                window = (_check_int("window", window), 0 if causal else window)
            else:
                window = (_check_int("window[0]", window[0]), _check_int("window[1]", window[1]))
        return _varlen(seqlens, causal, window, num_global, block_size, _dev(device))

    # ---- padded <-> packed -----------------------------------------------------------------------
    @staticmethod
    def unpad(x: Tensor, attention_mask: Tensor, *, seq_dim: int = -2) -> tuple[Tensor, "PackInfo"]:
        """Gather the real tokens of a padded batch into one packed sequence.
        x: (b, ..., s, ...) with the sequence at `seq_dim` (default: (b, h, s, d)); attention_mask
        (b, s) 1/0.  Returns (packed with batch 1 and length total at seq_dim, PackInfo);
        `PackInfo.layout(...)` builds the matching varlen layout and `SparseLayout.pad` undoes it."""
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
            raise InvalidArgumentError("unpad", "attention_mask", "a (batch, seq) tensor", repr(attention_mask))
        b, s = attention_mask.shape
        sd = seq_dim % x.dim()
        if sd == 0 or x.shape[0] != b or x.shape[sd] != s:
            raise InvalidArgumentError("unpad", "x", f"batch {b} at dim 0 and seq {s} at dim {seq_dim}", tuple(x.shape))
        keep = attention_mask.reshape(-1) != 0
        indices = torch.nonzero(keep).squeeze(1)                       # flat (batch*seq) positions of real tokens
        lens = (attention_mask != 0).sum(1)
        cu = torch.zeros(b + 1, dtype=torch.int32, device=attention_mask.device)
        cu[1:] = torch.cumsum(lens, 0)
        xs = x.movedim(sd, 1).reshape(b * s, *[n for i, n in enumerate(x.shape) if i not in (0, sd)])
        packed = xs.index_select(0, indices.to(x.device)).unsqueeze(0).movedim(1, sd)
        return packed, PackInfo(indices, cu, b, s, tuple(lens.tolist()))

    @staticmethod
    def pad(packed: Tensor, info: "PackInfo", *, seq_dim: int = -2, value: float = 0.0) -> Tensor:
        """Inverse of `unpad`: scatter a packed (1, ..., total, ...) tensor back to (b, ..., s, ...)."""
        sd = seq_dim % packed.dim()
        n = info.indices.numel()
        if packed.shape[0] != 1 or packed.shape[sd] != n:
            raise InvalidArgumentError("pad", "packed", f"batch 1 and {n} tokens at dim {seq_dim}", tuple(packed.shape))
        flat = packed.movedim(sd, 1).squeeze(0)                         # (total, rest...)
        out = flat.new_full((info.batch * info.seq, *flat.shape[1:]), value)
        out.index_copy_(0, info.indices.to(packed.device), flat)
        return out.reshape(info.batch, info.seq, *flat.shape[1:]).movedim(1, sd)

    # ---- kernel metadata ---------------------------------------------------------------------------
    def tile_index(self, block_m: int, block_n: int) -> "TileIndex":
        """Per-layout CSR-like lists of the (block_m x block_n) tiles a kernel must visit (cached)."""
        return tile_index(self.block_mask, self.key_padding_mask, self.cu_seqlens, self.block_size, self.causal,
                          self.window_left, self.window_right, self.num_global, self.seq_q, self.seq_k,
                          block_m, block_n)


class PackInfo(NamedTuple):
    indices: Tensor        # int64 flat positions (batch * seq) of the real tokens
    cu_seqlens: Tensor     # int32 (batch + 1,)
    batch: int
    seq: int
    seqlens: tuple[int, ...]

    def layout(self, *, causal: bool = False, window=None, num_global: int = 0, block_size: int = 128) -> SparseLayout:
        return SparseLayout.varlen(self.seqlens, causal=causal, window=window, num_global=num_global,
                                   block_size=block_size, device=self.cu_seqlens.device)


# ---- cached builders (hashable parameters only) --------------------------------------------------
_padding_cache: dict[tuple, SparseLayout] = {}      # key padding layouts by mask content (FIFO, 64 entries)

def _check_bs(bs) -> int:
    return _check_int("block_size", bs, 1)


def _normal_tensors(fn):
    """Cached layouts outlive the call that built them: their tensors are made outside inference mode, so a
    layout first built under torch.inference_mode() can still be saved for a later training call's backward."""
    @functools.wraps(fn)
    def build(*args):
        with torch.inference_mode(False):
            return fn(*args)
    return build


@functools.lru_cache(maxsize=256)
@_normal_tensors
def _dense(sq, sk, causal, bs, device) -> SparseLayout:
    _check_bs(bs)
    _check_int("seq_q", sq, 1), _check_int("seq_k", sk, 1)
    bm = torch.ones(1, 1, _nblocks(sq, bs), _nblocks(sk, bs), dtype=torch.bool, device=device)
    return SparseLayout(sq, sk, bs, bm, causal, dense_blocks=True)


@functools.lru_cache(maxsize=256)
@_normal_tensors
def _window(sq, sk, window, causal, ng, bs, device) -> SparseLayout:
    _check_bs(bs)
    _check_int("seq_q", sq, 1), _check_int("seq_k", sk, 1), _check_int("num_global", ng)
    bm = torch.zeros(1, 1, _nblocks(sq, bs), _nblocks(sk, bs), dtype=torch.bool, device=device)
    return SparseLayout(sq, sk, bs, bm, causal, window, ng)


@functools.lru_cache(maxsize=256)
@_normal_tensors
def _dilated(seq, bs, dilation, num_blocks, local_blocks, causal, device) -> SparseLayout:
    _check_bs(bs), _check_int("seq", seq, 1)
    n = _nblocks(seq, bs)
    p = torch.arange(n, device=device)
    dist = p[:, None] - p[None, :]
    bm = (dist.abs() < local_blocks) | ((dist % dilation == 0) & (
        True if num_blocks is None else dist.abs() <= num_blocks * dilation))
    return SparseLayout(seq, seq, bs, bm[None, None].contiguous(), causal)


@functools.lru_cache(maxsize=256)
@_normal_tensors
def _bigbird(seq, bs, window_blocks, global_blocks, random_blocks, heads, seed, causal, device) -> SparseLayout:
    _check_bs(bs), _check_int("seq", seq, 1)
    n = _nblocks(seq, bs)
    p = torch.arange(n)
    half = window_blocks // 2
    band = (p[None, :] >= p[:, None] - half) & (p[None, :] <= p[:, None] + (window_blocks - 1 - half))
    g = torch.Generator().manual_seed(seed)
    rnd = torch.zeros(heads, n, n, dtype=torch.bool)
    if random_blocks and n:
        r = min(random_blocks, n)
        picks = torch.rand(heads, n, n, generator=g).argsort(-1)[..., :r]   # r distinct random key blocks per row
        rnd.scatter_(2, picks, True)
    bm = (band[None] | rnd)[None].to(device).contiguous()
    return SparseLayout(seq, seq, bs, bm, causal, None, min(global_blocks * bs, seq))


@functools.lru_cache(maxsize=256)
@_normal_tensors
def _varlen(seqlens, causal, window, ng, bs, device) -> SparseLayout:
    _check_bs(bs)
    total = sum(seqlens)
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0).to(torch.int32)
    n = _nblocks(total, bs)
    dense = window is None and ng == 0           # plain varlen: every pair within a segment
    bm = torch.full((1, 1, n, n), dense, dtype=torch.bool, device=device)
    return SparseLayout(total, total, bs, bm, causal, window, ng, None, cu.to(device), dense, max(seqlens))


def _all_true(bm: Tensor) -> bool:
    """The dense_blocks fact of a block mask: read now, False (unknown) while a graph is captured."""
    return not capturing(bm) and bool(bm.all())


def _longest(cu: Tensor | None) -> int | None:
    """The max_seqlen fact of cu_seqlens: read now, None (unknown) while a graph is captured."""
    if cu is None or capturing(cu) or not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
        return None
    return int((cu[1:] - cu[:-1]).max())


def _refine(bm: Tensor, bs: int, new_bs: int, sq: int, sk: int) -> Tensor:
    """A block mask at a finer block size (new_bs divides bs)."""
    r = bs // new_bs
    out = bm.repeat_interleave(r, dim=2).repeat_interleave(r, dim=3)
    return out[:, :, :_nblocks(sq, new_bs), :_nblocks(sk, new_bs)]


def _and_opt(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return (a & b).contiguous()


# ---- the oracle ----------------------------------------------------------------------------------
def dense_mask(sq: int, sk: int, bs: int, block_mask: Tensor, causal: bool, window: tuple[int, int] | None,
               num_global: int, key_padding_mask: Tensor | None, cu_seqlens: Tensor | None, device=None) -> Tensor:
    """allowed(b, h, i, j) exactly as the module docstring defines it (naive and dense)."""
    device = device or block_mask.device
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    ip = i + (sk - sq)
    rule = block_mask.to(device)[:, :, (i // bs).expand(sq, sk), (j // bs).expand(sq, sk)]
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seg = torch.searchsorted(cu, torch.arange(sq, device=device), right=True) - 1
        start = cu[seg]
        rel_i, rel_j, same = i - start[:, None], j - start[None, :], seg[:, None] == seg[None, :]
    else:
        rel_i, rel_j, same = i, j, None
    extra = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        extra |= (j >= ip - left) & (j <= ip + right)
    if num_global:
        extra |= (rel_i < num_global) | (rel_j < num_global)
    allowed = rule | extra
    if causal:
        allowed = allowed & (j <= ip)
    if same is not None:
        allowed = allowed & same
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(device)[:, None, None, :]
    return allowed
