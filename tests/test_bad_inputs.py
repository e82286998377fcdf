"""Every public entry point, walked with bad arguments: wrong dtype, device (meta), shape, range, None,
a mutated config. Each case must raise ``SparseRefError`` (never an IndexError, RuntimeError,
AttributeError, TypeError, ...) whose message names the argument.

The table is a list of ``(case id, call, name expected in the message)``; ``call`` receives a
fresh environment (pools, a manager with two live requests, batches, a Quest algorithm).
"""

import dataclasses
import types

import pytest
import torch

import sparse_ref
from sparse_ref import (
    ForwardBatch,
    ForwardMode,
    KVCacheManager,
    PageAllocator,
    ReqToTokenPool,
    SparseConfig,
    SparseRefError,
    TokenToKVPool,
    build_decode_batch,
    build_extend_batch,
    decode_step,
)
from sparse_ref.adaptor import lengths_from_selection, to_attention_metadata
from sparse_ref.algorithms import QuestAlgorithm, SparseAlgorithm, create_sparse_algorithm
from sparse_ref.attention import dense_decode_attention, sparse_decode_attention
from sparse_ref.hadamard import hadamard_matrix, hadamard_transform
from sparse_ref.kernels import quest as quest_kernels
from sparse_ref.kernels import tuning
from sparse_ref.kernels.quest import quest_page_scores_from_queries
from sparse_ref.metrics import attention_mass_kept, page_attention_mass, page_recall, relative_error
from sparse_ref.rope import apply_rope
from sparse_ref.selection import select_pages, select_pages_row, topk_reference

P, H, D = 4, 2, 8
META = torch.device("meta")


class Env(types.SimpleNamespace):
    pass


def make_env() -> Env:
    m = KVCacheManager.create(max_requests=3, max_context_len=32, num_pages=20, page_size=P, num_kv_heads=1,
                              head_dim=D)
    reqs = [m.admit(10), m.admit(5)]
    algo = QuestAlgorithm(SparseConfig(page_budget=1, num_recent_pages=1))
    algo.initialize_representation_pool(0, 1, m.token_to_kv_pool, m.req_to_token_pool)
    ext = build_extend_batch(m, reqs)
    dec = decode_step(m, reqs)
    pool = m.token_to_kv_pool
    q = torch.randn(2, H, D)
    mask = torch.ones(2, dtype=torch.bool)
    sel, lens = algo.retrieve_topk(q, 0, dec.req_pool_indices, mask, forward_batch=dec)
    probs = dense_decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], m.req_to_token_pool.req_to_token,
                                   dec.req_pool_indices, dec.seq_lens, return_probs=True)[1]
    mass = page_attention_mass(probs, P)
    kernel_args = dict(queries=q, page_min=algo.page_min[0], page_max=algo.page_max[0],
                       page_valid=algo.page_valid[0], req_to_token=m.req_to_token_pool.req_to_token,
                       req_pool_indices=dec.req_pool_indices)
    kernel_args = {k: v.to(sparse_ref.default_device()) for k, v in kernel_args.items()}  # the launcher's device
    return Env(m=m, reqs=reqs, algo=algo, ext=ext, dec=dec, pool=pool, r2t=m.req_to_token_pool.req_to_token, q=q,
               mask=mask, sel=sel, lens=lens, mass=mass, scores=torch.randn(2, 8), kargs=kernel_args)


def fb_with(fb, **change):
    """A ForwardBatch-like object with fields replaced, skipping ForwardBatch's own checks (a hand-made batch)."""
    return types.SimpleNamespace(**{**vars(fb), **change})


def retrieve(e, algo=None, loop=False, **change):
    algo = algo or e.algo
    args = dict(queries=e.q, layer_id=0, req_pool_indices=e.dec.req_pool_indices, sparse_mask=e.mask,
                forward_batch=e.dec)
    args.update(change)
    fn = algo.retrieve_topk_loop if loop else algo.retrieve_topk
    fb = args.pop("forward_batch")
    return fn(*args.values(), forward_batch=fb)


def fixed_algo(e):
    class Fixed(SparseAlgorithm):
        def score_pages(self, queries, layer_id, req_pool_indices, forward_batch):
            return torch.zeros(req_pool_indices.shape[0], self.max_pages)

    a = Fixed(SparseConfig(page_budget=1, num_recent_pages=1))
    a.initialize_representation_pool(0, 1, e.pool, e.m.req_to_token_pool)
    return a


def to_meta(x):
    return x.to(META)


def metadata(e, **change):
    args = dict(selected=e.sel, lengths=e.lens, sparse_mask=e.mask, forward_batch=e.dec, req_to_token=e.r2t,
                page_size=P)
    args.update(change)
    return to_attention_metadata(**args)


def dense(e, **change):
    args = dict(q=e.q, k_buffer=e.pool.k_buffer[0], v_buffer=e.pool.v_buffer[0], req_to_token=e.r2t,
                req_pool_indices=e.dec.req_pool_indices, seq_lens=e.dec.seq_lens)
    args.update(change)
    return dense_decode_attention(**args)


def sparse(e, **change):
    table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    args = dict(q=e.q, k_buffer=e.pool.k_buffer[0], v_buffer=e.pool.v_buffer[0], page_table=table,
                kv_lens=torch.tensor([11, 6]), page_size=P)
    args.update(change)
    return sparse_decode_attention(**args)


def kernel(e, **change):
    knobs = {name: change.pop(name) for name in list(change) if name in quest_kernels.TUNING}  # launch knobs
    with tuning(quest_kernels.TUNING, **knobs):
        return quest_page_scores_from_queries(**{**e.kargs, "page_size": P, "max_pages": e.algo.max_pages, **change})


def decode_fields(e, **change):
    fields = {f.name: getattr(e.dec, f.name) for f in dataclasses.fields(ForwardBatch)}
    fields.update(change)
    return ForwardBatch(**fields)


def topk(e, **change):
    args = dict(scores=e.scores, k=2)
    args.update(change)
    return topk_reference(**args)


def select(e, **change):
    args = dict(scores=e.scores, seq_lens=torch.tensor([30, 9]), sparse_mask=e.mask, page_size=P,
                config=SparseConfig(page_budget=1))
    args.update(change)
    return select_pages(**args)


def select_row(e, **change):
    args = dict(scores_row=e.scores[0], seq_len=30, page_size=P, config=SparseConfig(page_budget=1))
    args.update(change)
    return select_pages_row(**args)


def recall(e, **change):
    args = dict(selected=e.sel, lengths=e.lens, page_mass=e.mass, seq_lens=e.dec.seq_lens, page_size=P)
    args.update(change)
    return page_recall(**args)


def kbuf(e):
    return e.pool.get_key_buffer(0)


CASES = [
    # ------------------------------------------------------------ pools and the manager
    ("r2t-size-str", lambda e: ReqToTokenPool("4", 8), "ReqToTokenPool(size)"),
    ("r2t-size-none", lambda e: ReqToTokenPool(None, 8), "ReqToTokenPool(size)"),
    ("r2t-ctx-float", lambda e: ReqToTokenPool(4, 8.0), "ReqToTokenPool(max_context_len)"),
    ("r2t-device-meta", lambda e: ReqToTokenPool(4, 8, "meta"), "ReqToTokenPool(device)"),
    ("r2t-device-typo", lambda e: ReqToTokenPool(4, 8, "cpux"), "ReqToTokenPool(device)"),
    ("r2t-alloc-none", lambda e: e.m.req_to_token_pool.alloc(None), "ReqToTokenPool.alloc(n)"),
    ("r2t-free-neg", lambda e: e.m.req_to_token_pool.free([-1]), "slot -1"),
    ("r2t-free-none", lambda e: e.m.req_to_token_pool.free(None), "ReqToTokenPool.free(slots)"),
    ("alloc-pages-none", lambda e: PageAllocator(None, 4), "PageAllocator(num_pages)"),
    ("alloc-page-size-float", lambda e: PageAllocator(4, 2.0), "PageAllocator(page_size)"),
    ("alloc-n-float", lambda e: e.m.allocator.alloc(1.5), "PageAllocator.alloc(n)"),
    ("alloc-free-neg", lambda e: e.m.allocator.free([-1]), "page -1"),
    ("alloc-free-float-tensor", lambda e: e.m.allocator.free(torch.tensor([1.0])), "PageAllocator.free(pages)"),
    ("alloc-listener-none", lambda e: e.m.allocator.add_free_listener(None), "callback"),
    ("kv-dtype-str", lambda e: TokenToKVPool(4, 2, 1, 1, 8, dtype="float16"), "dtype"),
    ("kv-dtype-int", lambda e: TokenToKVPool(4, 2, 1, 1, 8, dtype=torch.int32), "dtype"),
    ("kv-device-meta", lambda e: TokenToKVPool(4, 2, 1, 1, 8, device="meta"), "device"),
    ("kv-pages-none", lambda e: TokenToKVPool(None, 2, 1, 1, 8), "num_pages"),
    ("kv-layers-huge", lambda e: TokenToKVPool(4, 2, 2**40, 1, 8), "TokenToKVPool"),
    ("kv-slots-over-int32", lambda e: TokenToKVPool(2**20, 2**12, 1, 1, 8), "page_size"),
    ("r2t-size-huge", lambda e: ReqToTokenPool(2**40, 8), "ReqToTokenPool(size)"),
    ("r2t-too-big", lambda e: ReqToTokenPool(2**30, 2**30), "ReqToTokenPool"),
    ("kv-layer-float", lambda e: e.pool.get_key_buffer(0.0), "layer"),
    ("kv-layer-none", lambda e: e.pool.get_value_buffer(None), "layer"),
    ("kv-layer-range", lambda e: e.pool.get_key_buffer(1), "layer"),
    ("kv-set-loc-float", lambda e: e.pool.set_kv(0, torch.tensor([4.0]), torch.zeros(1, 1, D), torch.zeros(1, 1, D)),
     "loc"),
    ("kv-set-loc-meta", lambda e: e.pool.set_kv(0, torch.tensor([4], device=META), torch.zeros(1, 1, D),
                                                torch.zeros(1, 1, D)), "loc"),
    ("kv-set-loc-neg", lambda e: e.pool.set_kv(0, torch.tensor([-1]), torch.zeros(1, 1, D), torch.zeros(1, 1, D)),
     "slots"),
    ("kv-set-k-shape", lambda e: e.pool.set_kv(0, torch.tensor([4]), torch.zeros(1, 2, D), torch.zeros(1, 1, D)), "k"),
    ("kv-set-v-none", lambda e: e.pool.set_kv(0, torch.tensor([4]), torch.zeros(1, 1, D), None), "v"),
    ("mgr-none", lambda e: KVCacheManager(None, e.pool), "req_to_token_pool"),
    ("mgr-admit-none", lambda e: e.m.admit(None), "admit(num_tokens)"),
    ("mgr-admit-neg", lambda e: e.m.admit(-1), "admit(num_tokens)"),
    ("mgr-admit-huge", lambda e: e.m.admit(10**12), "max_context_len"),
    ("mgr-grow-float", lambda e: e.m.grow(e.reqs[0], 1.5), "grow(num_tokens)"),
    ("mgr-grow-none-req", lambda e: e.m.grow(None), "grow(req)"),
    ("mgr-release-none", lambda e: e.m.release(None), "release(req)"),
    ("mgr-slot-of-range", lambda e: e.m.slot_of(e.reqs[0], 99), "slot_of(t)"),
    # ------------------------------------------------------------ batch builders and ForwardBatch
    ("extend-manager-none", lambda e: build_extend_batch(None, e.reqs), "manager"),
    ("extend-requests-none", lambda e: build_extend_batch(e.m, None), "requests"),
    ("extend-request-none", lambda e: build_extend_batch(e.m, [None]), "requests"),
    ("extend-prefix-float", lambda e: build_extend_batch(e.m, e.reqs, [1.5, 0]), "prefix_lens[0]"),
    ("extend-prefix-range", lambda e: build_extend_batch(e.m, e.reqs, [0, 99]), "prefix_lens[1]"),
    ("extend-prefix-int", lambda e: build_extend_batch(e.m, e.reqs, 5), "prefix_lens"),
    ("fb-loc-neg", lambda e: decode_fields(e, out_cache_loc=torch.tensor([-4, 9])), "out_cache_loc"),
    ("extend-requests-tensor", lambda e: build_extend_batch(e.m, torch.tensor(1.0)), "requests"),
    ("decode-requests-str", lambda e: build_decode_batch(e.m, "ab"), "requests"),
    ("decode-step-manager", lambda e: decode_step(None, e.reqs), "manager"),
    ("fb-mode-str", lambda e: decode_fields(e, forward_mode="decode"), "forward_mode"),
    ("fb-seq-float", lambda e: decode_fields(e, seq_lens=e.dec.seq_lens.float()), "seq_lens"),
    ("fb-seq-none", lambda e: decode_fields(e, seq_lens=None), "seq_lens"),
    ("fb-seq-neg", lambda e: decode_fields(e, seq_lens=torch.tensor([-1, 6]), positions=torch.tensor([-2, 5])),
     "seq_lens"),
    ("fb-rows-neg", lambda e: decode_fields(e, req_pool_indices=torch.tensor([-1, 1])), "req_pool_indices"),
    ("fb-positions", lambda e: decode_fields(e, positions=e.dec.positions - 1), "positions"),
    ("fb-meta", lambda e: decode_fields(e, **{f: to_meta(getattr(e.dec, f)) for f in
                                              ("req_pool_indices", "seq_lens", "positions", "out_cache_loc")}),
     "req_pool_indices"),
    ("fb-seq-shape", lambda e: decode_fields(e, seq_lens=e.dec.seq_lens[:1]), "seq_lens"),
    ("fb-extend-missing", lambda e: ForwardBatch(ForwardMode.EXTEND, e.ext.req_pool_indices, e.ext.seq_lens,
                                                 e.ext.positions, e.ext.out_cache_loc), "extend_prefix_lens"),
    # ------------------------------------------------------------ SparseConfig (and a mutated one)
    ("cfg-ratio-str", lambda e: SparseConfig(keep_ratio="0.5"), "keep_ratio"),
    ("cfg-ratio-nan", lambda e: SparseConfig(keep_ratio=float("nan")), "keep_ratio"),
    ("cfg-budget-huge", lambda e: SparseConfig(page_budget=2**40), "page_budget"),
    ("cfg-recent-huge", lambda e: SparseConfig(num_recent_pages=2**31), "num_recent_pages"),
    ("cfg-sink-neg", lambda e: SparseConfig(num_sink_pages=-1), "num_sink_pages"),
    ("cfg-min-float", lambda e: SparseConfig(min_sparse_seq_len=1.0), "min_sparse_seq_len"),
    ("cfg-gqa-none", lambda e: SparseConfig(gqa_mode=None), "gqa_mode"),
    ("cfg-both", lambda e: SparseConfig(keep_ratio=0.5, page_budget=2), "keep_ratio"),
    ("cfg-replace-bad", lambda e: dataclasses.replace(SparseConfig(), num_recent_pages=0), "num_recent_pages"),
    ("cfg-replace-huge", lambda e: dataclasses.replace(SparseConfig(), min_sparse_seq_len=2**63), "min_sparse_seq_len"),
    # ------------------------------------------------------------ topk_reference
    ("topk-scores-int", lambda e: topk(e, scores=e.scores.long()), "scores"),
    ("topk-scores-meta", lambda e: topk(e, scores=to_meta(e.scores)), "scores"),
    ("topk-scores-none", lambda e: topk(e, scores=None), "scores"),
    ("topk-scores-1d", lambda e: topk(e, scores=e.scores[0]), "scores"),
    ("topk-k-none", lambda e: topk(e, k=None), "k"),
    ("topk-k-float", lambda e: topk(e, k=2.5), "k"),
    ("topk-k-neg", lambda e: topk(e, k=-1), "k"),
    ("topk-k-tensor-float", lambda e: topk(e, k=torch.tensor([1.0, 2.0])), "k"),
    ("topk-k-tensor-rows", lambda e: topk(e, k=torch.tensor([1, 2, 3])), "k"),
    ("topk-k-tensor-meta", lambda e: topk(e, k=torch.tensor([1, 2], device=META)), "k"),
    ("topk-k-int64-huge", lambda e: topk(e, k=2**31), "k"),
    ("topk-k-tensor-huge", lambda e: topk(e, k=torch.tensor([1, 2**31])), "k"),
    ("topk-width-neg", lambda e: topk(e, width=-1), "width"),
    ("topk-width-float", lambda e: topk(e, width=2.0), "width"),
    ("topk-lengths-float", lambda e: topk(e, lengths=torch.tensor([1.0, 2.0])), "lengths"),
    ("topk-lengths-meta", lambda e: topk(e, lengths=torch.tensor([1, 2], device=META)), "lengths"),
    ("topk-order", lambda e: topk(e, order="desc"), "order"),
    # ------------------------------------------------------------ select_pages / select_pages_row
    ("select-scores-meta", lambda e: select(e, scores=to_meta(e.scores)), "scores"),
    ("select-seq-meta", lambda e: select(e, seq_lens=torch.tensor([30, 9], device=META)), "seq_lens"),
    ("select-seq-float", lambda e: select(e, seq_lens=torch.tensor([30.0, 9.0])), "seq_lens"),
    ("select-seq-range", lambda e: select(e, seq_lens=torch.tensor([33, 9])), "seq_lens"),
    ("select-seq-neg", lambda e: select(e, seq_lens=torch.tensor([-1, 9])), "seq_lens"),
    ("select-mask-rows", lambda e: select(e, sparse_mask=e.mask[:1]), "sparse_mask"),
    ("select-mask-none", lambda e: select(e, sparse_mask=None), "sparse_mask"),
    ("select-page-size-0", lambda e: select(e, page_size=0), "page_size"),
    ("select-page-size-float", lambda e: select(e, page_size=4.0), "page_size"),
    ("select-config-none", lambda e: select(e, config=None), "config"),
    ("select-config-namespace", lambda e: select(e, config=types.SimpleNamespace(**vars(SparseConfig()))), "config"),
    ("select-width-small", lambda e: select(e, width=1), "width"),
    ("row-page-size-0", lambda e: select_row(e, page_size=0), "page_size"),
    ("row-config-none", lambda e: select_row(e, config=None), "config"),
    ("row-seq-neg", lambda e: select_row(e, seq_len=-1), "seq_len"),
    ("row-seq-float", lambda e: select_row(e, seq_len=2.5), "seq_len"),
    ("row-seq-range", lambda e: select_row(e, seq_len=33), "seq_len"),
    ("row-scores-2d", lambda e: select_row(e, scores_row=e.scores), "scores_row"),
    # ------------------------------------------------------------ retrieve_topk / loop, base and Quest
    *[(f"{who}{'-loop' if loop else ''}-{cid}", (lambda c, w, lp: lambda e: retrieve(
        e, fixed_algo(e) if w == "base" else None, lp, **c(e)))(change, who, loop), name)
      for who in ("base", "quest") for loop in (False, True)
      for cid, change, name in [
          ("rows-range", lambda e: {"req_pool_indices": torch.tensor([0, 3])}, "req_pool_indices"),
          ("rows-neg", lambda e: {"req_pool_indices": torch.tensor([-1, 1])}, "req_pool_indices"),
          ("rows-float", lambda e: {"req_pool_indices": torch.tensor([0.0, 1.0])}, "req_pool_indices"),
          ("rows-meta", lambda e: {"req_pool_indices": to_meta(e.dec.req_pool_indices)}, "req_pool_indices"),
          ("rows-flipped", lambda e: {"req_pool_indices": e.dec.req_pool_indices.flip(0)}, "req_pool_indices"),
          ("queries-int", lambda e: {"queries": e.q.long()}, "queries"),
          ("queries-none", lambda e: {"queries": None}, "queries"),
          ("queries-rows", lambda e: {"queries": e.q[:1]}, "queries"),
          ("mask-none", lambda e: {"sparse_mask": None}, "sparse_mask"),
          ("mask-meta", lambda e: {"sparse_mask": to_meta(e.mask)}, "sparse_mask"),
          ("fb-none", lambda e: {"forward_batch": None}, "forward_batch"),
          ("fb-seq-past", lambda e: {"forward_batch": fb_with(e.dec, seq_lens=torch.tensor([33, 6]))}, "seq_lens"),
          ("fb-seq-meta", lambda e: {"forward_batch": fb_with(e.dec, seq_lens=to_meta(e.dec.seq_lens))}, "seq_lens"),
          ("fb-no-rows", lambda e: {"forward_batch": types.SimpleNamespace(seq_lens=e.dec.seq_lens)},
           "req_pool_indices"),
          ("layer-float", lambda e: {"layer_id": 0.0}, "layer_id"),
          ("layer-str", lambda e: {"layer_id": "0"}, "layer_id"),
          ("layer-range", lambda e: {"layer_id": 1}, "layer_id"),
      ]],
    # ------------------------------------------------------------ adaptor
    ("meta-fb-none", lambda e: metadata(e, forward_batch=None), "forward_batch"),
    ("meta-page-size-0", lambda e: metadata(e, page_size=0), "page_size"),
    ("meta-page-size-none", lambda e: metadata(e, page_size=None), "page_size"),
    ("meta-selected-meta", lambda e: metadata(e, selected=to_meta(e.sel)), "selected"),
    ("meta-lengths-meta", lambda e: metadata(e, lengths=to_meta(e.lens)), "lengths"),
    ("meta-lengths-float", lambda e: metadata(e, lengths=e.lens.float()), "lengths"),
    ("meta-r2t-meta", lambda e: metadata(e, req_to_token=to_meta(e.r2t)), "req_to_token"),
    ("meta-rows-range", lambda e: metadata(e, forward_batch=fb_with(e.dec, req_pool_indices=torch.tensor([0, 9]))),
     "req_pool_indices"),
    ("meta-seq-past-max", lambda e: metadata(e, forward_batch=fb_with(e.dec, seq_lens=torch.tensor([11, 40]))),
     "seq_lens"),
    ("meta-seq-past-tokens", lambda e: metadata(e, sparse_mask=torch.zeros(2, dtype=torch.bool),
                                                forward_batch=fb_with(e.dec, seq_lens=torch.tensor([11, 20]))),
     "seq_lens"),
    ("meta-out-bad", lambda e: metadata(e, out=(1, 2, 3)), "out"),
    ("lengths-from-none", lambda e: lengths_from_selection(None), "selected"),
    # ------------------------------------------------------------ attention
    ("dense-q-int", lambda e: dense(e, q=e.q.long()), "q"),
    ("dense-q-none", lambda e: dense(e, q=None), "q"),
    ("dense-k-meta", lambda e: dense(e, k_buffer=to_meta(e.pool.k_buffer[0])), "k_buffer"),
    ("dense-v-shape", lambda e: dense(e, v_buffer=e.pool.v_buffer[0][:4]), "v_buffer"),
    ("dense-rows-neg", lambda e: dense(e, req_pool_indices=torch.tensor([-1, 1])), "req_pool_indices"),
    ("dense-rows-range", lambda e: dense(e, req_pool_indices=torch.tensor([0, 7])), "req_pool_indices"),
    ("dense-seq-past-max", lambda e: dense(e, seq_lens=torch.tensor([11, 40])), "seq_lens"),
    ("dense-seq-past-tokens", lambda e: dense(e, seq_lens=torch.tensor([11, 20])), "seq_lens"),
    ("dense-seq-rows", lambda e: dense(e, seq_lens=torch.tensor([11])), "seq_lens"),
    ("dense-scale-str", lambda e: dense(e, scale="x"), "scale"),
    ("sparse-scale-nan", lambda e: sparse(e, scale=float("nan")), "scale"),
    ("sparse-page-size-0", lambda e: sparse(e, page_size=0), "page_size"),
    ("sparse-page-size-none", lambda e: sparse(e, page_size=None), "page_size"),
    ("sparse-kv-neg", lambda e: sparse(e, kv_lens=torch.tensor([-1, 6])), "kv_lens"),
    ("sparse-table-float", lambda e: sparse(e, page_table=torch.zeros(2, 3)), "page_table"),
    ("sparse-table-neg", lambda e: sparse(e, page_table=torch.tensor([[1, -2, 3], [4, 5, 0]])), "page_table"),
    # ------------------------------------------------------------ metrics
    ("mass-probs-int", lambda e: page_attention_mass(torch.zeros(2, 1, 4, dtype=torch.int64), P), "probs"),
    ("mass-page-size-0", lambda e: page_attention_mass(torch.zeros(2, 1, 4), 0), "page_size"),
    ("kept-selected-none", lambda e: attention_mass_kept(None, e.lens, e.mass), "selected: expected a torch.Tensor"),
    ("kept-mass-rows", lambda e: attention_mass_kept(e.sel, e.lens, e.mass[:1]), "page_mass"),
    ("kept-lengths-meta", lambda e: attention_mass_kept(e.sel, to_meta(e.lens), e.mass), "lengths"),
    ("recall-seq-none", lambda e: recall(e, seq_lens=None), "seq_lens"),
    ("recall-page-size-0", lambda e: recall(e, page_size=0), "page_size"),
    ("recall-k-neg", lambda e: recall(e, k=-1), "k"),
    ("relerr-shape", lambda e: relative_error(torch.zeros(2, 3), torch.zeros(2, 4)), "out"),
    ("relerr-none", lambda e: relative_error(torch.zeros(2, 3), None), "ref"),
    # ------------------------------------------------------------ rope / hadamard
    ("rope-dim-odd", lambda e: apply_rope(torch.zeros(3, 8), torch.arange(3), 3), "rope_dim"),
    ("rope-dim-float", lambda e: apply_rope(torch.zeros(3, 8), torch.arange(3), 4.0), "rope_dim"),
    ("rope-positions-float", lambda e: apply_rope(torch.zeros(3, 8), torch.zeros(3), 4), "positions"),
    ("rope-theta-neg", lambda e: apply_rope(torch.zeros(3, 8), torch.arange(3), 4, theta=-1.0), "theta"),
    ("hadamard-dtype-str", lambda e: hadamard_matrix(4, dtype="float32"), "dtype"),
    ("hadamard-scale-str", lambda e: hadamard_transform(torch.zeros(4), "x"), "scale"),
    ("hadamard-x-int", lambda e: hadamard_transform(torch.zeros(4, dtype=torch.int64)), "x"),
    # ------------------------------------------------------------ registry and Quest hooks
    ("registry-name", lambda e: create_sparse_algorithm("nope"), "nope"),
    ("registry-config", lambda e: create_sparse_algorithm("quest", "cfg"), "config"),
    ("registry-device-meta", lambda e: create_sparse_algorithm("quest", None, "meta"), "device"),
    ("registry-backend", lambda e: create_sparse_algorithm("quest", None, "cpu", backend="gpu"),
     "backend"),
    ("registry-kwarg", lambda e: create_sparse_algorithm("quest", None, "cpu", scoring="torch"), "kwargs"),
    ("register-name", lambda e: __import__("sparse_ref.algorithms").algorithms.register_sparse_algorithm(
        None, QuestAlgorithm), "name"),
    ("register-cls", lambda e: __import__("sparse_ref.algorithms").algorithms.register_sparse_algorithm(
        "x", object), "cls"),
    ("quest-scoring-backend", lambda e: QuestAlgorithm(backend=None), "backend"),
    ("quest-init-start-float", lambda e: QuestAlgorithm().initialize_representation_pool(
        0.5, 1, e.pool, e.m.req_to_token_pool), "start_layer"),
    ("quest-init-end-range", lambda e: QuestAlgorithm().initialize_representation_pool(
        0, 2, e.pool, e.m.req_to_token_pool), "end_layer"),
    ("quest-init-pool-none", lambda e: QuestAlgorithm().initialize_representation_pool(
        0, 1, None, e.m.req_to_token_pool), "token_to_kv_pool"),
    ("quest-init-r2t-none", lambda e: QuestAlgorithm().initialize_representation_pool(0, 1, e.pool, None),
     "req_to_token_pool"),
    ("quest-hook-uninit", lambda e: QuestAlgorithm().construct_representations(0, e.ext, kbuf(e)),
     "initialize_representation_pool"),
    ("quest-construct-fb-none", lambda e: e.algo.construct_representations(0, None, kbuf(e)), "forward_batch"),
    ("quest-construct-mode", lambda e: e.algo.construct_representations(0, e.dec, kbuf(e)), "EXTEND"),
    ("quest-construct-layer-float", lambda e: e.algo.construct_representations(0.0, e.ext, kbuf(e)), "layer_id"),
    ("quest-construct-kbuf-int", lambda e: e.algo.construct_representations(0, e.ext, kbuf(e).long()), "k_buffer"),
    ("quest-construct-kbuf-meta", lambda e: e.algo.construct_representations(0, e.ext, to_meta(kbuf(e))),
     "k_buffer"),
    ("quest-construct-kbuf-shape", lambda e: e.algo.construct_representations(0, e.ext, kbuf(e)[:8]), "k_buffer"),
    ("quest-construct-seq-past", lambda e: e.algo.construct_representations(0, dataclasses.replace(
        e.ext, seq_lens=e.ext.seq_lens + 8, extend_seq_lens=e.ext.extend_seq_lens + 8,
        positions=torch.cat([torch.arange(18), torch.arange(13)]), out_cache_loc=torch.cat(
            [e.r2t[e.reqs[0].req_pool_idx, :18], e.r2t[e.reqs[1].req_pool_idx, :13]]).long()), kbuf(e)), "seq_lens"),
    ("quest-update-mode", lambda e: e.algo.update_representations(0, e.ext, kbuf(e)), "DECODE"),
    ("quest-update-fb-namespace", lambda e: e.algo.update_representations(0, fb_with(e.dec), kbuf(e)),
     "forward_batch"),
    ("quest-update-rows-range", lambda e: e.algo.update_representations(0, dataclasses.replace(
        e.dec, req_pool_indices=torch.tensor([0, 5])), kbuf(e)), "req_pool_indices"),
    ("quest-invalidate-neg", lambda e: e.algo.invalidate_pages([-1]), "invalidate_pages(pages)"),
    ("quest-invalidate-range", lambda e: e.algo.invalidate_pages(torch.tensor([20])), "invalidate_pages(pages)"),
    ("quest-invalidate-float", lambda e: e.algo.invalidate_pages([1.5]), "invalidate_pages(pages)"),
    # ------------------------------------------------------------ the Quest kernel launcher
    ("kernel-rows-none", lambda e: kernel(e, req_pool_indices=None), "req_pool_indices"),
    ("kernel-rows-float", lambda e: kernel(e, req_pool_indices=e.kargs["req_pool_indices"].float()),
     "req_pool_indices"),
    ("kernel-rows-meta", lambda e: kernel(e, req_pool_indices=to_meta(e.kargs["req_pool_indices"])),
     "req_pool_indices"),
    ("kernel-rows-neg", lambda e: kernel(e, req_pool_indices=e.kargs["req_pool_indices"] - 100), "req_pool_indices"),
    ("kernel-queries-meta", lambda e: kernel(e, queries=to_meta(e.kargs["queries"])), "queries"),
    ("kernel-queries-int", lambda e: kernel(e, queries=e.kargs["queries"].long()), "queries"),
    ("kernel-min-none", lambda e: kernel(e, page_min=None), "page_min"),
    ("kernel-max-shape", lambda e: kernel(e, page_max=e.kargs["page_max"][:-1]), "page_max"),
    ("kernel-valid-int", lambda e: kernel(e, page_valid=e.kargs["page_valid"].int()), "page_valid"),
    ("kernel-out-shape", lambda e: kernel(e, out=torch.empty(1, 1, device=e.kargs["queries"].device)), "out"),
    ("kernel-page-size-0", lambda e: kernel(e, page_size=0), "page_size"),
    ("kernel-block-p", lambda e: kernel(e, block_p=3), "block_p"),
]


def test_the_table_is_large_and_ids_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 200, len(CASES)


@pytest.mark.parametrize("call, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_sparse_ref_error_naming_the_argument(call, name):
    e = make_env()
    with pytest.raises(SparseRefError) as info:
        call(e)
    assert name in str(info.value), str(info.value)
