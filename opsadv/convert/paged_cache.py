"""PagedKVCache: a transformers `Cache` whose keys and values live in opsadv's paged KV cache, so that a converted
model's `generate` runs prefill and decode through `opsadv.ops.paged_attention` (append + attend in one call).

    model = opsadv.convert_model(model)
    cache = opsadv.PagedKVCache(model, max_cache_len=4096, page_size=16)
    out = model.generate(**batch, past_key_values=cache, max_new_tokens=256)

Layout: per layer one page pool k/v (num_pages, page_size, Hkv, D); one block table (batch, pages per sequence)
shared by every layer; pages are taken from a free list as sequences grow (static=True: each sequence owns a fixed
run of pages from the start, nothing is allocated later).

The seam.  A transformers attention module calls `past_key_values.update(k, v, layer_idx)` BEFORE its attention
function, and that function gets only (module, query, key, value, mask, **kwargs).  transformers' own paged cache
(continuous batching) avoids the problem by passing `past_key_values=None` and the cache through kwargs, which only
its own batching loop does; `generate` passes the cache to the layers.  So here `update` writes nothing: it records
the new tokens as this cache's pending update of that layer and returns them unchanged, and opsadv's attention
function (convert/hf_attention.py), finding its `key` argument to be exactly that pending tensor, hands the call to
the cache, which runs paged_attention(q, pages, block table, lengths, k_new=key, v_new=value).  Any other attention
function would see only the new tokens, so that is made impossible or loud:
- the cache is built for one converted model and refuses a model whose attention layers are not all transformers
  interface layers running opsadv's attention, or that needs what paged_attention does not compute (sliding window,
  softcapping, sinks, cross-attention); `update` re-checks the layer's attention implementation each call;
- an update that no opsadv attention consumed raises at the next `update` / mask sizing (the next layer, or the
  next forward of a one-layer model); a forward that stopped half-way leaves the cache refusing use until reset();
- the attention refuses (raises, never falls back) calls with dropout, softcapping, sinks, a position bias, a window
  or a mask that is not transformers' plain causal one.

Padding.  Keys are stored compacted: only real tokens (the 2-D attention_mask's ones) enter the pages, so each
sequence has its own length and no step needs a key mask; a padded prefill runs packed (cu_seqlens_q) over the real
query rows, whose outputs are scattered back (padded rows get 0).  get_mask_sizes reports the new tokens only
(kv_length = query length, kv_offset = positions seen), so opsadv's mask function hands over exactly the padding of
the new tokens.  get_seq_length is the number of positions processed (padding included), which is what
transformers derives positions from; `lengths` are the real tokens cached per sequence.

Beam search and batch expansion.  transformers 5.25's generate expands the prompt (num_beams or num_return_sequences
copies, `_expand_inputs_for_generation`) BEFORE prefill, so each copy's prompt is prefilled into its own pages; beam
search then calls `reorder_cache(beam_idx)` after every step (its first call gathers every beam from beam 0, so the
copies' pages go back to the pool at once); sampling with num_return_sequences only has a larger batch.  generate
calls neither batch_repeat_interleave nor batch_select_indices (callers of their own do); the three go through one
seam, _select_sequences: block table rows gathered, so beams share the pages of their common prefix (counted in
_refs, which only holds pages of more than one sequence: the no-beam path never touches it); pages no sequence holds
go back to the free list; a shared, partly filled last page is copied (every layer) just before a sequence appends
into it (copy-on-write, in _plan), so appends never write into another sequence's tokens.  With static=True the
fixed runs stay each sequence's: a reorder copies the selected sequences' used pages into the runs (one gather per
layer on the device, no host read unless a padded prefill's record must follow; transformers' StaticCache also
copies), so the batch (num_beams x prompts) must fit max_batch_size.

CUDA graphs.  With `convert_model(model, cuda_graphs=True)` and a static cache, each decode step (one new token per
sequence) replays one captured graph per (batch, buffers) signature; prefill and other multi-token steps run eagerly
(the prompt's shape changes per call, and a padded prompt's compaction reads its padding on the host; prefill is
compute-bound, so a graph would save little).  The cache plans those calls itself (graph_step, runtime/graphs.py's
GraphStep): a decode step is keyed and captured on the new tokens' columns of generate's growing 2-D mask only
(keys are compacted: the earlier columns are already in the lengths), under a view where the mask is sized for the
new tokens (get_mask_sizes (q, 0)), so nothing of the position is baked into the graph; the lengths advance on the
device inside the graph, and the host counters (positions, the length bound, calls) once per replay
(graph_replayed).  Refused with the reason: a non-static cache (its pages are allocated on the host as sequences
grow), a decode step without position_ids (they would be derived from the host count at capture), a mask that is
not the 2-D padding mask of every position.

Not supported (refused with an error): sliding-window layers, encoder-decoder caches, offloading."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from opsadv import ops
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.explain import explain as _explain
from opsadv.runtime.graphs import GraphStep

from . import hf_attention as H
from .hf_attention import paged_pending as _pending
from .masks import causal_mask_of, form_of
from .state import scope_of

NAME = "PagedKVCache"


class PagedLayer(CacheLayerMixin):
    """One layer's page pool.  The cache (PagedKVCache) owns the block table and the lengths; this holds the pages."""

    is_compileable = False
    is_sliding = False
    is_croppable = True                           # crop puts lengths and pages back exactly
    supports_early_init = False

    def __init__(self, cache: "PagedKVCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        c = self.cache
        shape = (c.num_pages, c.page_size, key_states.shape[1], key_states.shape[-1])
        dtype = c.dtype or key_states.dtype
        self.keys = torch.zeros(shape, dtype=dtype, device=key_states.device)
        self.values = torch.zeros(shape, dtype=dtype, device=key_states.device)
        c._graph_epoch += 1                       # new buffers: graphs captured over the old ones must not replay
        if not torch.compiler.is_compiling():      # fixed addresses: CUDA graphs replay over the same pages
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kc = self.keys
        if key_states.shape[1] != kc.shape[2] or key_states.shape[-1] != kc.shape[3] \
                or key_states.dtype != kc.dtype or key_states.device != kc.device:
            raise InvalidArgumentError(NAME, f"layer {self.layer_idx} key_states",
                                       f"(batch, {kc.shape[2]} kv heads, s, {kc.shape[3]}) {kc.dtype} on {kc.device} "
                                       "(the pages' heads, head_dim, dtype and device)",
                                       f"{tuple(key_states.shape)} {key_states.dtype} on {key_states.device}")
        return key_states, value_states           # the new tokens: opsadv's attention appends them (module docstring)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.cache._seen

    def get_seq_length(self) -> int:
        return self.cache._seen

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def reset(self) -> None:
        pass                                      # the cache resets its lengths and pages; contents need no zeroing

    def crop(self, tokens_to_remove: int) -> None:
        pass                                      # the cache crops (lengths are shared by the layers)

    def reorder_cache(self, beam_idx) -> None:
        pass                                      # the cache reorders its block table (shared by the layers)


@dataclass
class _Step:
    """One forward's metadata, made at the first layer and shared by the others."""
    q_len: int
    seqlens: torch.Tensor                 # int32 (batch,), lengths after this step's append
    rows: torch.Tensor | None             # packed prefill: the real (batch * q_len) rows, else None
    cu: torch.Tensor | None               # packed prefill: cu_seqlens_q
    pad: torch.Tensor | None = None       # static decode with padding: (batch,) int32, 1 = real new token


class PagedKVCache(Cache):
    """A paged KV cache for `model.generate(..., past_key_values=cache)` on an opsadv-converted transformers model
    (module docstring).

    model: the converted model (convert_model(model)); its attention layers must all run opsadv's attention.
    max_cache_len: the most tokens one sequence may hold (default: the config's max_position_embeddings).
    max_batch_size: the most sequences (default 1 for static, else taken from the first forward).
    page_size: tokens per page (a power of two >= 8; 16 by default).
    num_pages: the pool size shared by the sequences (default: enough for max_batch_size sequences of
      max_cache_len, the batch taken from the first forward when max_batch_size is None).
    dtype: the pages' dtype (default: the keys' dtype); static: every sequence owns ceil(max_cache_len / page_size)
      pages from the start and no step allocates or reads lengths on the host (decode steps capture in CUDA graphs).
    """

    def __init__(self, model, *, max_cache_len: int | None = None, max_batch_size: int | None = None,
                 page_size: int = 16, num_pages: int | None = None, dtype: torch.dtype | None = None,
                 static: bool = False):
        self.modules_by_layer = _attention_layers(model)
        n = len(self.modules_by_layer)
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        if max_cache_len is None:
            max_cache_len = getattr(cfg, "max_position_embeddings", None)
            if not isinstance(max_cache_len, int):
                raise InvalidArgumentError(NAME, "max_cache_len", "an int (the config has no max_position_embeddings)",
                                           repr(max_cache_len))
        for arg, v, lo in (("max_cache_len", max_cache_len, 1), ("page_size", page_size, 8),
                           ("max_batch_size", max_batch_size, 1), ("num_pages", num_pages, 1)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise InvalidArgumentError(NAME, arg, f"an int >= {lo}", repr(v))
        if page_size & (page_size - 1):
            raise InvalidArgumentError(NAME, "page_size", "a power of two >= 8 (paged_attention's pages)",
                                       repr(page_size))
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise InvalidArgumentError(NAME, "dtype", "None, float16, bfloat16 or float32", str(dtype))
        if not isinstance(static, bool):
            raise InvalidArgumentError(NAME, "static", "a bool", repr(static))
        self._max_cache_len, self.page_size, self.dtype, self.static = max_cache_len, page_size, dtype, static
        self.pages_per_seq = -(-max_cache_len // page_size)
        if static and max_batch_size is None:
            max_batch_size = 1
        self._max_batch_size = max_batch_size
        self._num_pages_arg = num_pages
        self.num_pages = num_pages if num_pages is not None else (
            max_batch_size * self.pages_per_seq if max_batch_size is not None else None)
        if static and self.num_pages < max_batch_size * self.pages_per_seq:
            raise InvalidArgumentError(NAME, "num_pages", f">= max_batch_size x ceil(max_cache_len / page_size) = "
                                       f"{max_batch_size * self.pages_per_seq} (static: every sequence owns its pages)",
                                       repr(num_pages))
        super().__init__(layers=[PagedLayer(self, i) for i in range(n)])
        self.calls = {"prefill": 0, "decode": 0}  # paged_attention calls served, by kind
        self._last_call = None                    # the last call's arguments (explain())
        self._graph_epoch = 0                     # bumped when device buffers are replaced (CUDA graphs' key)
        self._graph_view = False                  # a graphed decode step is being captured (get_mask_sizes)
        self._static_bufs = None                  # static: (block table, lengths) on the device, kept across reset
        self._clear()

    # properties of our own: transformers < 5.25's Cache defines read-only ones (over its layers)
    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int | None) -> None:
        self._max_batch_size = value

    # ---- state ---------------------------------------------------------------------------------------------------
    def _clear(self) -> None:
        self._seen = 0                            # positions processed, padding included (get_seq_length)
        self._bound = 0                           # the longest sequence's real tokens (host; static decode adds)
        self._batch = None
        self._lens: list[int] = []                # real tokens cached per sequence (host)
        self._pages: list[list[int]] = []         # each sequence's pages, in order
        self._free = list(range(self.num_pages - 1, -1, -1)) if self.num_pages is not None else []
        self._refs: dict[int, int] = {}           # page -> sequences holding it, for pages held by more than one
        self._real: list = []                     # (first position, (batch, n) bool tensor) of padded forwards
        if self.static and getattr(self, "_lens_dev", None) is not None:
            self._static_bufs = (self._table_dev, self._lens_dev)   # reused by a batch of the same size
        self._table = self._table_dev = self._lens_dev = None
        self._step: _Step | None = None
        self._next_layer = 0                      # the layer whose update comes next in this forward (0: none open)
        self._in_forward = False
        if _pending[0] is not None and _pending[0][0] is self:
            _pending[0] = None

    def reset(self) -> None:
        """Forget every sequence (pages back to the pool; a later forward may use another batch size)."""
        self._clear()

    @property
    def lengths(self) -> list[int]:
        """The real (non-padding) tokens cached per sequence."""
        return list(self._host_lens())

    def _host_lens(self) -> list[int]:
        if self._lens is None:                    # static decode steps kept them on the device only
            self._lens = self._lens_dev.tolist()
        return self._lens

    @property
    def batch_size(self) -> int:
        return -1 if self._batch is None else self._batch

    @property
    def is_compileable(self) -> bool:
        return False                              # generate must not auto-compile (prefill allocates on the host)

    def _check_idle(self, what: str) -> None:
        if _pending[0] is not None and _pending[0][0] is self:
            layer = _pending[0][1]
            _pending[0] = None
            self._in_forward = True               # what was appended is unknown now: refuse until reset
            raise RuntimeError(
                f"{NAME}: layer {layer}'s new keys were not consumed by opsadv's attention before {what}: the layer "
                "ran another attention implementation, which saw only the new tokens (its output is wrong). "
                "PagedKVCache serves only models converted with opsadv.convert_model whose layers run opsadv's "
                "attention; call cache.reset() before reusing this cache")
        if self._in_forward:
            raise RuntimeError(f"{NAME}: an earlier forward stopped before its last layer ({what} now), so the cache "
                               "holds a partial step; call cache.reset() (and generate again) to use it")

    # ---- transformers' Cache API ---------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self._check_idle("the next forward's first layer")
            self._start(key_states)
        elif layer_idx != self._next_layer:
            if _pending[0] is not None and _pending[0][0] is self:
                self._check_idle(f"layer {layer_idx}'s update")
            raise RuntimeError(f"{NAME}: layers must update in order 0..{len(self.layers) - 1} once per forward; "
                               f"expected layer {self._next_layer}, got layer {layer_idx}")
        elif _pending[0] is not None:
            self._check_idle(f"layer {layer_idx}'s update")
        mod = self.modules_by_layer[layer_idx]
        impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
        if impl != "opsadv":
            self._in_forward = True
            raise RuntimeError(f"{NAME}: layer {layer_idx} runs attention implementation {impl!r}, not 'opsadv': "
                               "only opsadv's attention appends to the paged cache (convert the model with "
                               "opsadv.convert_model and keep its attention implementation); call cache.reset()")
        if key_states.shape[-1] != value_states.shape[-1]:
            self._in_forward = True
            raise InvalidArgumentError(NAME, f"layer {layer_idx} update", "keys and values of one head dim (pages hold "
                                       "both)", f"key_states {tuple(key_states.shape)}, value_states "
                                       f"{tuple(value_states.shape)}; call cache.reset()")
        k, v = self.layers[layer_idx].update(key_states, value_states)
        if k.shape[2] != self._step_q_len:
            raise InvalidArgumentError(NAME, f"layer {layer_idx} key_states", f"{self._step_q_len} new tokens (as "
                                       "layer 0 in this forward)", f"{k.shape[2]}")
        _pending[0] = (self, layer_idx, k, v)
        self._next_layer = layer_idx + 1
        return k, v

    def _start(self, key_states) -> None:
        """A forward begins (layer 0's update): the batch is fixed by the first forward after a reset."""
        b = key_states.shape[0]
        if self._batch is None:
            if self.max_batch_size is not None and b > self.max_batch_size:
                raise InvalidArgumentError(NAME, "batch", f"<= max_batch_size = {self.max_batch_size}", str(b))
            if self.num_pages is None:           # the pool sized by the first batch
                self.num_pages = b * self.pages_per_seq
                self._free = list(range(self.num_pages - 1, -1, -1))
            self._batch = b
            self._lens = [0] * b
            self._pages = [[] for _ in range(b)]
            dev = key_states.device
            self._table = torch.zeros(b, self.pages_per_seq, dtype=torch.int32)
            if self.static:
                if b * self.pages_per_seq > self.num_pages:
                    raise InvalidArgumentError(NAME, "batch", f"<= {self.num_pages // self.pages_per_seq} (static: "
                                               "every sequence owns ceil(max_cache_len / page_size) pages)", str(b))
                for i in range(b):
                    self._pages[i] = list(range(i * self.pages_per_seq, (i + 1) * self.pages_per_seq))
                    self._table[i] = torch.tensor(self._pages[i], dtype=torch.int32)
                self._free = []
            kept = self._static_bufs if self.static else None
            if kept is not None and kept[1].shape[0] == b and kept[1].device == dev:
                # the same fixed runs again: the same buffers, so graphs captured before a reset still replay
                self._table_dev, self._lens_dev = kept
                self._table_dev.copy_(self._table)
                self._lens_dev.zero_()
                return self._begin(key_states)
            self._table_dev = self._table.to(dev)
            self._lens_dev = torch.zeros(b, dtype=torch.int32, device=dev)
            self._graph_epoch += 1
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self._table_dev)
                torch._dynamo.mark_static_address(self._lens_dev)
        elif b != self._batch:
            raise InvalidArgumentError(NAME, "batch", f"{self._batch} (the batch this cache holds; reset() first "
                                       "for another)", str(b))
        self._begin(key_states)

    def _begin(self, key_states) -> None:
        self._step_q_len = key_states.shape[2]
        self._step = None
        self._next_layer = 0
        self._in_forward = True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self._check_idle("the next forward's mask")
        if self._graph_view:                      # a graphed decode step's mask holds the new tokens' columns only
            return query_length, 0
        return query_length, self._seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0 if self._graph_view else self._seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last positions: crop(-n) removes n; crop(n > 0) keeps n (transformers' older meaning); crop(0)
        does nothing."""
        self._check_idle("crop")
        if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool):
            raise InvalidArgumentError(NAME, "crop", "an int", repr(tokens_to_remove))
        if tokens_to_remove == 0:
            return                                # transformers' crop(0): nothing to remove
        keep = self._seen + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self._seen)
        if keep < 0:
            raise InvalidArgumentError(NAME, "crop", f">= -{self._seen} (the positions cached)",
                                       str(tokens_to_remove))
        if keep == self._seen or self._batch is None:
            return
        real = self._real_mask()[:, :keep]        # (batch, positions kept): which of them are real tokens
        self._real = [(0, real)]
        self._lens = real.sum(1).tolist()
        self._bound = max(self._lens, default=0)
        self._seen = keep
        if not self.static:
            for b, n in enumerate(self._lens):    # pages past the kept tokens go back to the pool
                need = -(-n // self.page_size)
                while len(self._pages[b]) > need:
                    self._release(self._pages[b].pop())
        self._lens_dev.copy_(torch.tensor(self._lens, dtype=torch.int32))

    def _real_mask(self) -> torch.Tensor:
        """(batch, positions seen) bool: which positions hold real tokens."""
        m = torch.ones(self._batch, self._seen, dtype=torch.bool)
        for start, real in self._real:
            m[:, start:start + real.shape[1]] = real.to("cpu", torch.bool)   # (graphed decode records stay on the device)
        return m

    # ---- beam search and batch expansion: sequences share pages -------------------------------------------------
    def reorder_cache(self, beam_idx) -> None:
        """Beam search's step: sequence i continues sequence beam_idx[i] (block table rows gathered, pages shared)."""
        self._select_sequences("reorder_cache", beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence becomes `repeats` consecutive copies that share its pages (nothing is copied now; a shared,
        partly filled last page is copied when a copy first appends into it)."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise InvalidArgumentError(NAME, "batch_repeat_interleave repeats", "an int >= 1", repr(repeats))
        if self._batch is not None and repeats > 1:
            self._select_sequences("batch_repeat_interleave", torch.arange(self._batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices) -> None:
        """Keep the sequences `indices` (ints, in the new order, repeats allowed, or a (batch,) bool mask)."""
        self._select_sequences("batch_select_indices", indices)

    def _select_sequences(self, what: str, idx) -> None:
        """The batch becomes sequences idx (each an index into the current batch): the one seam of reorder / expand /
        select.  Paged: block table rows gathered, page refcounts recounted, pages no sequence holds freed.
        Static: the selected sequences' used pages copied into the fixed runs (no host read of idx or lengths)."""
        self._check_idle(what)
        if self._batch is None:
            return                                # nothing cached yet: the next forward fixes the batch
        b = self._batch
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            if tuple(idx.shape) != (b,):
                raise InvalidArgumentError(NAME, f"{what} indices", f"a ({b},) bool mask", f"{tuple(idx.shape)}")
            idx = idx.nonzero().squeeze(1)
        if idx.ndim != 1 or idx.numel() == 0 or idx.dtype.is_floating_point or idx.is_complex():
            raise InvalidArgumentError(NAME, f"{what} indices", "a non-empty 1-D integer tensor of sequence indices",
                                       f"{tuple(idx.shape)} {idx.dtype}")
        nb = idx.numel()
        if self.max_batch_size is not None and nb > self.max_batch_size:
            raise InvalidArgumentError(NAME, f"{what} batch", f"<= max_batch_size = {self.max_batch_size}", str(nb))
        host = idx.cpu() if (not self.static or self._real or idx.device.type == "cpu") else None
        if host is not None and (int(host.min()) < 0 or int(host.max()) >= b):
            raise InvalidArgumentError(NAME, f"{what} indices", f"in [0, {b}) (the cached sequences)",
                                       f"[{int(host.min())}, {int(host.max())}]")
        if self.static:
            self._select_static(idx, nb)
        else:
            self._select_paged(host)
        if self._real:                            # crop's record of padding follows the sequences
            self._real = [(start, real[host]) for start, real in self._real]
        self._batch = nb

    def _select_paged(self, idx: torch.Tensor) -> None:
        order = idx.tolist()
        if order == list(range(self._batch)):
            return                                # beams kept their places (a common beam step): nothing moves
        lens = self._host_lens()
        pages = [list(self._pages[i]) for i in order]
        held: dict[int, int] = {}
        for row in pages:
            for p in row:
                held[p] = held.get(p, 0) + 1
        dropped = {p for row in self._pages for p in row}.difference(held)
        self._free.extend(sorted(dropped, reverse=True))          # (the free list pops its end: low pages first)
        self._refs = {p: n for p, n in held.items() if n > 1}
        self._pages = pages
        self._lens = [lens[i] for i in order]
        self._bound = max(self._lens, default=0)
        self._table = self._table[idx]            # rows past a sequence's pages are rewritten before they are read
        dev = self._table_dev.device
        lens_dev = torch.tensor(self._lens, dtype=torch.int32)
        if len(order) == self._table_dev.shape[0]:
            self._table_dev.copy_(self._table, non_blocking=True)
            self._lens_dev.copy_(lens_dev)
        else:
            self._table_dev, self._lens_dev = self._table.to(dev), lens_dev.to(dev)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self._table_dev)
                torch._dynamo.mark_static_address(self._lens_dev)

    def _select_static(self, idx: torch.Tensor, nb: int) -> None:
        if nb * self.pages_per_seq > self.num_pages:
            raise InvalidArgumentError(NAME, "batch", f"<= {self.num_pages // self.pages_per_seq} (static: every "
                                       "sequence owns ceil(max_cache_len / page_size) pages)", str(nb))
        dev = self._table_dev.device
        idx = idx.to(dev)
        old_table = self._table_dev
        if nb != self._batch:                     # the fixed runs of the new batch
            self._table = torch.arange(nb * self.pages_per_seq, dtype=torch.int32).view(nb, self.pages_per_seq)
            self._pages = [row.tolist() for row in self._table]
            self._table_dev = self._table.to(dev)
            self._lens_dev = self._lens_dev[idx]
            self._graph_epoch += 1
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self._table_dev)
                torch._dynamo.mark_static_address(self._lens_dev)
        else:
            self._lens_dev.copy_(self._lens_dev[idx])
        self._lens = None                         # on the device only (lengths reads them back)
        used = -(-self._bound // self.page_size)  # pages per sequence that can hold tokens
        if used:                                  # each sequence's pages copied into its run (gather, then write)
            src = old_table[idx, :used].reshape(-1).long()
            dst = self._table_dev[:, :used].reshape(-1).long()
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[dst] = layer.keys[src]
                    layer.values[dst] = layer.values[src]

    def _release(self, page: int) -> None:
        """A sequence lets go of a page: back to the pool unless another sequence still holds it."""
        n = self._refs.get(page, 1)
        if n > 2:
            self._refs[page] = n - 1
        elif n == 2:
            del self._refs[page]
        else:
            self._free.append(page)

    def _own_last_pages(self, new: list[int]) -> bool:
        """Copy-on-write: a sequence about to append into a partly filled last page that another sequence also holds
        gets its own copy of that page first (every layer's keys and values).  True if a table row changed."""
        src, dst = [], []
        for b, (have, n) in enumerate(zip(self._lens, new)):
            if n == have or have % self.page_size == 0:
                continue                          # no append, or it starts a fresh page
            p = self._pages[b][-1]
            if self._refs.get(p, 1) == 1:
                continue
            if not self._free:
                raise InvalidArgumentError(NAME, "num_pages", "a free page to copy a shared page into before a beam "
                                           "appends to it", f"a pool of {self.num_pages} pages, all held "
                                           "(pass a larger num_pages)")
            q = self._free.pop()
            self._release(p)
            self._pages[b][-1] = q
            self._table[b, len(self._pages[b]) - 1] = q
            src.append(p)
            dst.append(q)
        if not src:
            return False
        dev = self._table_dev.device
        s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        for layer in self.layers:
            layer.keys[d] = layer.keys[s]
            layer.values[d] = layer.values[s]
        return True

    def early_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{NAME} initializes its pages at the first forward (torch.export of the cache "
                                  "is not supported)")

    # ---- the attention (called by opsadv's attention function) ----------------------------------------------------
    def attend(self, module, query, key, value, mask, dropout, scaling, is_causal, position_bias, kwargs):
        """paged_attention over this cache with the pending new tokens appended; ((b, s, Hq, D) output, None)."""
        layer = _pending[0][1]
        _pending[0] = None
        why = _refused_call(module, layer, dropout, is_causal, position_bias, kwargs)
        if why is None:
            why = _mask_refusal(mask, query)
        if why is not None:
            self._in_forward = True               # nothing appended for this layer: the cache needs a reset
            raise InvalidArgumentError(NAME, f"layer {layer} attention call", "a plain causal call opsadv's "
                                       "paged_attention computes exactly", why)
        if self._step is None:
            self._step = self._plan(mask, query.shape[2])
        st = self._step
        q = query.transpose(1, 2)                 # (b, s, Hq, D) from transformers' (b, Hq, s, D)
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        pages = self.layers[layer]
        with scope_of(module):
            if st.rows is None:
                args = (q.contiguous(), pages.keys, pages.values, self._table_dev, st.seqlens)
                kw = dict(causal=True, scale=scaling, k_new=k.contiguous(), v_new=v.contiguous())
                out = ops.paged_attention(*args, **kw)
                if st.pad is not None:            # a padding new token's row is 0 (as the packed path's)
                    out = out * st.pad.view(-1, 1, 1, 1).to(out.dtype)
            else:                                 # padded prefill: the real rows packed
                b, s = q.shape[:2]
                qp = q.reshape(b * s, *q.shape[2:])[st.rows]
                args = (qp, pages.keys, pages.values, self._table_dev, st.seqlens)
                kw = dict(cu_seqlens_q=st.cu, causal=True, scale=scaling,
                          k_new=k.reshape(b * s, *k.shape[2:])[st.rows], v_new=v.reshape(b * s, *v.shape[2:])[st.rows])
                outp = ops.paged_attention(*args, **kw)
                out = outp.new_zeros(b * s, *outp.shape[1:]).index_copy_(0, st.rows, outp).view(q.shape)
        if not torch.compiler.is_compiling():    # (host counters would make a compiled step recompile)
            self.calls["decode" if st.q_len == 1 else "prefill"] += 1
            if layer == 0:
                self._last_call = (args, kw)
        if layer == len(self.layers) - 1:
            self._in_forward = False              # the forward's every layer appended: the step is complete
        return out, None

    def _plan(self, mask, q_len: int) -> _Step:
        """The step's lengths, pages and (padded prefill) packed rows; commits the lengths."""
        cm = causal_mask_of(mask)
        kpm = None if cm is None else cm.key_padding
        dev = self._table_dev.device
        if kpm is not None and self.static and q_len == 1 and tuple(kpm.shape) == (self._batch, 1):
            return self._decode_padded(kpm)
        if kpm is None:                           # every new token real
            counts = None
            if self.static:                       # no host read or allocation: lengths on the device only
                if self._bound + q_len > self.max_cache_len:
                    raise InvalidArgumentError(NAME, "sequence length", f"<= max_cache_len = {self.max_cache_len}",
                                               f"{self._bound + q_len} tokens in the longest sequence")
                self._bound += q_len
                seqlens = self._lens_dev + q_len
                self._lens_dev.copy_(seqlens)
                self._lens = None                 # stale on the host (lengths reads the device copy)
                self._seen += q_len               # (all real: nothing to record for crop)
                return _Step(q_len, seqlens, None, None)
            counts = [q_len] * self._batch
        else:
            if tuple(kpm.shape) != (self._batch, q_len):
                raise InvalidArgumentError(NAME, "attention mask", f"key padding of the {q_len} new tokens "
                                           f"({self._batch}, {q_len})", f"{tuple(kpm.shape)}")
            kh = kpm.to("cpu", torch.bool)        # a padded forward reads its padding once (prefill)
            counts = kh.sum(1).tolist()
        new = [a + c for a, c in zip(self._host_lens(), counts)]
        for b, n in enumerate(new):
            if n > self.max_cache_len:
                raise InvalidArgumentError(NAME, "sequence length", f"<= max_cache_len = {self.max_cache_len}",
                                           f"{n} tokens in sequence {b}")
        grew = False
        if not self.static:
            if self._refs:                        # beams share pages: copy a shared last page before writing into it
                grew = self._own_last_pages(new)
            for b, n in enumerate(new):
                need = -(-n // self.page_size)
                while len(self._pages[b]) < need:
                    if not self._free:
                        raise InvalidArgumentError(
                            NAME, "num_pages", f"enough pages: {sum(-(-x // self.page_size) for x in new)} needed",
                            f"a pool of {self.num_pages} pages of {self.page_size} tokens (pass a larger num_pages)")
                    p = self._free.pop()
                    self._table[b, len(self._pages[b])] = p
                    self._pages[b].append(p)
                    grew = True
        if grew:
            self._table_dev.copy_(self._table, non_blocking=True)
        self._lens = new
        self._bound = max(new, default=0)
        seqlens = torch.tensor(new, dtype=torch.int32).to(dev, non_blocking=True)
        self._lens_dev.copy_(seqlens)
        rows = cu = None
        if kpm is not None:
            self._commit(q_len, kh)
            if not all(c == q_len for c in counts):
                rows = kh.reshape(-1).nonzero().squeeze(1).to(dev)
                cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
        else:
            self._commit(q_len, None)
        return _Step(q_len, seqlens, rows, cu)

    def _decode_padded(self, kpm: torch.Tensor) -> _Step:
        """A static decode step whose mask marks the new tokens' padding, on the device only (a captured step cannot
        read it): every row appends at its length and attends over it, a real token's length then advances; a
        padding token's key so lies past its sequence's length (its next real token overwrites it), its row is 0."""
        if self._bound + 1 > self.max_cache_len:
            raise InvalidArgumentError(NAME, "sequence length", f"<= max_cache_len = {self.max_cache_len}",
                                       f"{self._bound + 1} tokens in the longest sequence")
        self._bound += 1
        real = kpm.reshape(-1).to(torch.int32)
        seqlens = self._lens_dev + 1
        self._lens_dev.add_(real)
        self._lens = None
        self._real.append((self._seen, kpm))      # crop's record (a graphed replay records its own mask instead)
        self._seen += 1
        return _Step(1, seqlens, None, None, real)

    # ---- CUDA graphs (runtime/graphs.py's graph-state protocol) ---------------------------------------------------
    def graph_step(self, args: tuple, kwargs: dict) -> GraphStep:
        """How a CudaGraphRunner runs this forward (module docstring, CUDA graphs): eager for prefill and multi-token
        steps; a decode step replays, keyed and captured on its canonical arguments."""
        if not self.static:
            raise InvalidArgumentError("cuda_graphs", "cache", "opsadv.PagedKVCache(model, static=True, "
                                       "max_batch_size=...): its pages and lengths stay in place, so a graph can "
                                       "replay the decode step", "PagedKVCache(static=False): pages are allocated "
                                       "on the host as sequences grow")
        self._check_idle("a graphed forward")
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise InvalidArgumentError("cuda_graphs", "input_ids", "a (batch, new tokens) tensor (or inputs_embeds) "
                                       "with a PagedKVCache", type(x).__name__)
        q_len = x.shape[1]
        if self._batch is None or q_len != 1:
            return GraphStep("prefill" if self._batch is None else f"a {q_len}-token step (only one-token decode "
                             "steps replay)")
        if x.shape[0] != self._batch:
            raise InvalidArgumentError(NAME, "batch", f"{self._batch} (the batch this cache holds; reset() first "
                                       "for another)", str(x.shape[0]))
        if self._bound + q_len > self.max_cache_len:
            raise InvalidArgumentError(NAME, "sequence length", f"<= max_cache_len = {self.max_cache_len}",
                                       f"{self._bound + q_len} tokens in the longest sequence")
        if not isinstance(kwargs.get("position_ids"), torch.Tensor):
            raise InvalidArgumentError("cuda_graphs", "position_ids", "a (batch, 1) tensor with a PagedKVCache "
                                       "decode step (generate passes them): without them the model derives positions "
                                       "from the cache's host count, which a replayed graph would repeat",
                                       repr(kwargs.get("position_ids")))
        kw = dict(kwargs)
        mask = kw.get("attention_mask")
        new = None
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (self._batch,
                                                                                             self._seen + q_len):
                raise InvalidArgumentError("cuda_graphs", "attention_mask", f"None or the 2-D padding mask of every "
                                           f"position, ({self._batch}, {self._seen + q_len}), with a PagedKVCache "
                                           "decode step", f"{tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
                                           else type(mask).__name__)
            # the earlier columns are in the lengths already: the step needs the new tokens' columns only
            new = mask[:, -q_len:].clone(memory_format=torch.contiguous_format)
            kw["attention_mask"] = new
        return GraphStep(None, args, kw, (NAME, self._batch, q_len, mask is not None, self._graph_epoch),
                         (q_len, new))

    def graph_view(self):
        """The context a graphed decode step is warmed up and captured in: masks sized for the new tokens only."""
        cache = self

        class _View:
            def __enter__(self):
                cache._graph_view = True

            def __exit__(self, *exc):
                cache._graph_view = False
        return _View()

    _HOST = ("_seen", "_bound", "_lens", "_real", "calls", "_step", "_next_layer", "_in_forward")

    def graph_snapshot(self):
        """Host counters and device lengths before a warm-up / capture (graph_restore puts them back)."""
        host = {k: copy.copy(getattr(self, k)) for k in self._HOST}
        return host, (None if self._lens_dev is None else self._lens_dev.clone())

    def graph_restore(self, snap) -> None:
        host, lens = snap
        for k, v in host.items():
            setattr(self, k, copy.copy(v))
        if lens is not None:
            self._lens_dev.copy_(lens)
        if _pending[0] is not None and _pending[0][0] is self:
            _pending[0] = None                    # a warm-up that stopped half-way left its update pending

    def graph_replayed(self, step: GraphStep) -> None:
        """After a replay: the host side of the step the graph ran on the device (lengths advanced there)."""
        q_len, new = step.info
        if new is not None:
            self._real.append((self._seen, new))  # crop's record: this step's padding (a device tensor)
        self._seen += q_len
        self._bound += q_len
        self._lens = None
        self.calls["decode" if q_len == 1 else "prefill"] += len(self.layers)

    def _commit(self, q_len: int, real) -> None:
        if real is not None:                      # positions past the recorded ones are real tokens (crop)
            self._real.append((self._seen, real))
        self._seen += q_len

    def explain(self):
        """opsadv.explain of the last step's paged_attention call (layer 0): which kernel served it, and why."""
        if self._last_call is None:
            raise RuntimeError(f"{NAME}.explain: no forward has run through this cache yet")
        args, kw = self._last_call
        return _explain("paged_attention", *args, **kw)

    def __repr__(self) -> str:
        return (f"{NAME}(layers={len(self.layers)}, page_size={self.page_size}, num_pages={self.num_pages}, "
                f"max_cache_len={self.max_cache_len}, static={self.static}, lengths={self.lengths}, "
                f"positions={self._seen}, calls={self.calls})")


# ---- what the cache serves ---------------------------------------------------------------------------------------
def _language_model(model):
    """The module whose layers take the cache: transformers' get_decoder() (a vision-language model's language
    model; its vision tower's attention never sees the cache), else the model."""
    get = getattr(model, "get_decoder", None)
    try:
        dec = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model without one (the whole model then)
        dec = None
    return dec if isinstance(dec, torch.nn.Module) else model


def _attention_layers(model) -> list:
    """The model's attention modules by layer_idx (0..L-1, each once), all running opsadv's attention; raises with
    the reason for a model the paged cache cannot serve exactly."""
    if not H.is_transformers_model(model):
        raise InvalidArgumentError(NAME, "model", "a transformers PreTrainedModel converted with opsadv.convert_model",
                                   type(model).__name__)
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise InvalidArgumentError(NAME, "model", "a decoder-only model (encoder-decoder caches are not supported)",
                                   type(model).__name__)
    mods = [m for _, m in H.attention_modules(_language_model(model))]
    if not mods:
        raise InvalidArgumentError(NAME, "model", "a model with transformers attention layers", type(model).__name__)
    by_layer = {}
    for m in mods:
        idx = getattr(m, "layer_idx", None)
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if impl != "opsadv" or getattr(m, "_opsadv_state", None) is None:
            raise InvalidArgumentError(NAME, "model", "a model converted with opsadv.convert_model (every attention "
                                       "layer running opsadv's attention)",
                                       f"{type(m).__name__} with attention implementation {impl!r}")
        if not isinstance(idx, int) or idx in by_layer:
            raise InvalidArgumentError(NAME, "model", "attention layers with distinct layer_idx",
                                       f"{type(m).__name__} with layer_idx {idx!r}")
        w = H._layer_window(m)
        if w is not None:
            raise InvalidArgumentError(NAME, "model", "full causal attention layers (paged_attention has no sliding "
                                       "window)", f"layer {idx} with sliding window {w}")
        if getattr(m, "sinks", None) is not None:
            raise InvalidArgumentError(NAME, "model", "attention without sinks", f"layer {idx} with attention sinks")
        if getattr(m, "is_causal", True) is False:
            raise InvalidArgumentError(NAME, "model", "causal self-attention", f"layer {idx} with is_causal=False")
        by_layer[idx] = m
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    for attr in ("attn_logit_softcapping",):
        if getattr(text, attr, None) is not None:
            raise InvalidArgumentError(NAME, "model", "attention without logit softcapping",
                                       f"{attr}={getattr(text, attr)}")
    if getattr(text, "kv_lora_rank", None) is not None:   # its cache.update takes latents, not keys and values
        raise InvalidArgumentError(NAME, "model", "attention that caches keys and values (multi-head latent "
                                   "attention caches compressed latents; use transformers' own cache)",
                                   f"{type(model).__name__} with kv_lora_rank={text.kv_lora_rank}")
    n = getattr(text, "num_hidden_layers", None)
    if sorted(by_layer) != list(range(len(by_layer))) or (isinstance(n, int) and n != len(by_layer)):
        raise InvalidArgumentError(NAME, "model", f"attention layers 0..{(n or len(by_layer)) - 1}, every layer an "
                                   "attention layer", f"layer_idx {sorted(by_layer)}")
    return [by_layer[i] for i in range(len(by_layer))]


def _refused_call(module, layer, dropout, is_causal, position_bias, kwargs) -> str | None:
    if getattr(module, "layer_idx", layer) != layer:
        return f"module of layer {module.layer_idx} attending layer {layer}'s new keys"
    if dropout and dropout > 0:
        return f"attention dropout {dropout} (training mode; the paged cache is for inference)"
    if is_causal is False:
        return "is_causal=False"
    if position_bias is not None:
        return "a position bias"
    for k in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(k) is not None:
            return f"{k}={kwargs[k]!r}"
    return None


def _mask_refusal(mask, query) -> str | None:
    if mask is None:
        return None
    cm = causal_mask_of(mask)
    if cm is None:
        f = form_of(mask)
        return ("a mask opsadv's mask function did not build (a custom 4-D mask, packed sequences or an overlay)"
                if f is None else "a non-causal mask")
    if cm.window is not None:
        return "a sliding-window mask"
    return None
