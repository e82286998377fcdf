"""The paged FP8 indexer-logits kernel (``sparse_ref.kernels.dsa``) against the batched torch reference,
and the indexer's three scoring paths (per-request loop, batched torch, Triton) against each other.

Tolerance: the package's one policy, ``sparse_ref.metrics.assert_matches_reference(..., "fp8_logits")``.
Under the interpreter the kernel and the reference multiply the same FP8 values (exact in fp32) and
differ only in the order of fp32 sums: ``2e-5`` of a row's largest |logit|. On a GPU the tensor cores
accumulate FP8 products in reduced precision: the error follows the magnitude of the summed terms,
not a short row's (possibly cancelling) signed sum, so ``2e-3`` of the tensor's largest |logit|.
"""

import dataclasses
import math
import sys

import pytest
import torch
from aot_variants import DSA as AOT_VARIANTS
from torch.utils._python_dispatch import TorchDispatchMode

import sparse_ref
from sparse_ref import KVCacheManager, build_extend_batch, checks, decode_step
from sparse_ref.algorithms.dsa import LightningIndexer, paged_indexer_logits_reference
from sparse_ref.config import IndexerConfig
from sparse_ref.errors import ShapeError, SparseRefError
from sparse_ref.fp8 import FP8_DTYPE
from sparse_ref.kernels import dsa as kd
from sparse_ref.kernels import tuning
from sparse_ref.kernels.dsa import paged_indexer_logits as _paged_indexer_logits
from sparse_ref.kernels.dsa import plan_tiles
from sparse_ref.memory import IndexerKeyCache
from sparse_ref.metrics import assert_matches_reference
from sparse_ref.selection import topk_reference

DEV = sparse_ref.default_device()
ON_GPU = DEV.type == "cuda"


def paged_indexer_logits(*args, **kwargs):
    """The kernel, with any launch knobs among ``kwargs`` (tiles, block_t, queries_per_program) set in its TUNING."""
    knobs = {name: kwargs.pop(name) for name in list(kwargs) if name in kd.TUNING}
    with tuning(kd.TUNING, **knobs):
        return _paged_indexer_logits(*args, **kwargs)


def close(got, want):
    """Equal up to fp32 summation order (interpreter) or tensor-core FP8 accumulation (GPU): the package's policy."""
    if got.numel():
        assert_matches_reference(got, want, "fp8_logits", "paged_indexer_logits")


def random_cache(num_pages, page, d, fp8=True, seed=0):
    """A cache layer in the production layout: uint8 [num_pages, P*(D+4)], keys then scales per page."""
    g = torch.Generator().manual_seed(seed)
    if fp8:
        buf = torch.zeros(num_pages, page * (d + 4), dtype=torch.uint8)
        buf[:, : page * d].view(FP8_DTYPE).copy_((torch.randn(num_pages, page * d, generator=g) * 3).to(FP8_DTYPE))
        buf.view(torch.float32)[:, page * d // 4:].copy_(torch.rand(num_pages, page, generator=g) + 0.25)
        buf = buf.to(DEV)
        return buf[:, : page * d].view(FP8_DTYPE).view(num_pages, page, d), buf.view(torch.float32)[:, page * d // 4:]
    return (torch.randn(num_pages, page, d, generator=g).to(DEV),
            (torch.rand(num_pages, page, generator=g) + 0.25).to(DEV))


def make_case(page, d, h, lengths, tokens_per_req, fp8=True, seed=0):
    """Requests with ``lengths`` keys on pages in random physical order; each gets query tokens whose bounds
    are the last ``tokens_per_req`` positions (a chunked-prefill chunk; 1 = decode)."""
    g = torch.Generator().manual_seed(seed + 1)
    max_pages = max(1, max(-(-n // page) for n in lengths) + 1)
    num_pages = len(lengths) * max_pages + 3
    keys, scales = random_cache(num_pages, page, d, fp8, seed)
    perm = torch.randperm(num_pages - 1, generator=g)[: len(lengths) * max_pages] + 1  # never page 0
    block_table = perm.view(len(lengths), max_pages).to(torch.int32)
    token_req, bounds = [], []
    for b, n in enumerate(lengths):
        for j in range(min(tokens_per_req, n) if n else 1):
            token_req.append(b)
            bounds.append(n - j)
    T = len(bounds)
    q = torch.randn(T, h, d, generator=g) * 2
    q = q.to(FP8_DTYPE) if fp8 else q
    w = torch.randn(T, h, generator=g)
    token_req, bounds = torch.tensor(token_req, dtype=torch.int32), torch.tensor(bounds, dtype=torch.int32)
    return (q.to(DEV), w.to(DEV), keys, scales, block_table.to(DEV), token_req.to(DEV), bounds.to(DEV))


def assert_logits_close(got, want, bounds, fill_tail=True):
    visible = torch.arange(want.shape[1], device=want.device)[None, :] < bounds[:, None].long()
    close(got.masked_fill(~visible, 0), want.masked_fill(~visible, 0))
    if fill_tail:
        assert bool((got[~visible] == float("-inf")).all())


@pytest.mark.parametrize("page,d,h,block_t", [(64, 32, 4, 64), (16, 64, 16, 64),
                                               *[pytest.param(*c, marks=pytest.mark.knobs)
                                                 for c in ((4, 16, 3, 16), (24, 32, 5, 16))]])
def test_kernel_matches_reference_ragged_random_pages(page, d, h, block_t):
    # lengths 0, 1, 63, 64, 65 and a longer one; several query tokens per request (chunked prefill)
    case = make_case(page, d, h, [0, 1, 63, 64, 65, 100], tokens_per_req=2, seed=page + d)
    width = 112
    want = paged_indexer_logits_reference(*case, width)
    got = paged_indexer_logits(*case, width, block_t=block_t)
    assert_logits_close(got, want, case[-1])
    again = paged_indexer_logits(*case, width, block_t=block_t)
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(again))  # bitwise deterministic


@pytest.mark.knobs
@pytest.mark.parametrize("qb,fill_tail", [(2, True), (4, False)])
def test_several_queries_per_program_share_key_tiles(qb, fill_tail):
    """The prefill variant: groups of ``qb`` query tokens, including groups that span requests
    (lengths 0, 1, 2) and a token order that is not sorted by request."""
    q, w, keys, scales, bt, req, bounds = make_case(16, 32, 4, [0, 1, 2, 40, 70], tokens_per_req=3, seed=11)
    order = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(0)).to(DEV)
    case = (q[order].contiguous(), w[order].contiguous(), keys, scales, bt, req[order].contiguous(),
            bounds[order].contiguous())
    want = paged_indexer_logits_reference(*case, 80)
    out = torch.full((q.shape[0], 80), 9.0, device=DEV)
    paged_indexer_logits(*case, 80, queries_per_program=qb, fill_tail=fill_tail, out=out)
    assert_logits_close(out, want, case[-1], fill_tail=fill_tail)
    if not fill_tail:
        for t, n in enumerate(case[-1].tolist()):
            assert torch.all(out[t, n:] == 9.0)


@pytest.mark.knobs
def test_extend_batches_default_to_four_queries_per_program():
    """On average >= 4 query tokens per request: the multi-query program by default, same logits."""
    case = make_case(16, 32, 4, [3, 40, 70], tokens_per_req=6, seed=12)
    want = paged_indexer_logits_reference(*case, 80)
    got = paged_indexer_logits(*case, 80)
    assert_logits_close(got, want, case[-1])
    assert torch.equal(got, paged_indexer_logits(*case, 80, queries_per_program=4))
    one = paged_indexer_logits(*case, 80, queries_per_program=1)
    assert torch.equal(torch.isinf(got), torch.isinf(one))
    close(got.masked_fill(torch.isinf(got), 0), one.masked_fill(torch.isinf(one), 0))


def test_kernel_without_tail_fill_writes_only_the_visible_keys():
    case = make_case(64, 32, 4, [5, 130, 70], tokens_per_req=2, seed=3)
    width = 200
    out = torch.full((case[0].shape[0], width), 12345.0, device=DEV)
    paged_indexer_logits(*case, width, fill_tail=False, out=out)
    want = paged_indexer_logits_reference(*case, width)
    assert_logits_close(out, want, case[-1], fill_tail=False)
    for t, n in enumerate(case[-1].tolist()):
        assert torch.all(out[t, n:] == 12345.0)  # untouched past the bound


@pytest.mark.knobs
@pytest.mark.parametrize("qb", [1, 2])
def test_unchecked_rows_outside_the_block_table_read_nothing(qb):
    """check_values=False trusts the caller; a bad token_req row must still never read out of bounds:
    that token's logits are the -inf tail, the other tokens are untouched by the mistake."""
    q, w, keys, scales, block_table, token_req, bounds = make_case(16, 32, 4, [40, 23, 57], tokens_per_req=2, seed=5)
    want = paged_indexer_logits_reference(q, w, keys, scales, block_table, token_req, bounds, 64)
    bad = token_req.clone()
    bad[1], bad[4] = 10**6, -7  # far past the 3 block-table rows, and negative
    out = paged_indexer_logits(q, w, keys, scales, block_table, bad, bounds, 64, check_values=False,
                               queries_per_program=qb)
    good = [t for t in range(len(bad)) if t not in (1, 4)]
    assert_logits_close(out[good], want[good], bounds[good])
    assert torch.all(out[[1, 4]] == float("-inf"))


@pytest.mark.knobs
@pytest.mark.parametrize("tiles", [1, 2, 8])
def test_tiles_per_program_does_not_change_the_result(tiles):
    case = make_case(16, 32, 4, [40, 97], tokens_per_req=2, seed=5)
    want = paged_indexer_logits(*case, 112, tiles=1)
    assert torch.equal(paged_indexer_logits(*case, 112, tiles=tiles), want)


def test_full_precision_cache_through_the_kernel():
    case = make_case(16, 32, 4, [1, 33, 50], tokens_per_req=2, fp8=False, seed=7)
    want = paged_indexer_logits_reference(*case, 64)
    got = paged_indexer_logits(*case, 64)
    assert_logits_close(got, want, case[-1])


def test_plan_tiles_targets_about_32_programs_per_sm():
    cuda = torch.device("cuda")
    real = kd._sm_count
    try:
        kd._sm_count = lambda device: 132
        assert plan_tiles(64, 65536, cuda) == 16  # 4096 programs: the best measured at bs=64, 64K
        assert plan_tiles(64, 16384, cuda) == 4 and plan_tiles(8, 65536, cuda) == 4  # at least MIN_TILES
        assert plan_tiles(1, 65536, cuda) == 1 and plan_tiles(1, 4096, cuda) == 1  # too little work for MIN_TILES
        assert plan_tiles(8192 // 4, 65536, cuda) == 64  # prefill, 4 queries per program
        assert plan_tiles(1024, 131072, cuda) == 64  # capped at MAX_TILES
    finally:
        kd._sm_count = real


def test_kernel_input_errors():
    q, w, keys, scales, bt, req, bounds = make_case(16, 32, 4, [10, 20], tokens_per_req=1)
    with pytest.raises(ShapeError, match="bounds: expected values in"):
        paged_indexer_logits(q, w, keys, scales, bt, req, bounds, 15)  # a bound past the width
    with pytest.raises(ShapeError, match="token_req: expected rows in"):
        paged_indexer_logits(q, w, keys, scales, bt, req + 5, bounds, 32)
    with pytest.raises(ShapeError, match="block_table: expected page ids"):
        paged_indexer_logits(q, w, keys, scales, bt + 1000, req, bounds, 32)
    with pytest.raises(ShapeError, match="weights: expected dtype"):
        paged_indexer_logits(q, w.double(), keys, scales, bt, req, bounds, 32)
    with pytest.raises(ShapeError, match="keys: expected dtype"):
        paged_indexer_logits(q.float(), w, keys, scales, bt, req, bounds, 32)
    with pytest.raises(ShapeError, match="block_table: expected dtype"):
        paged_indexer_logits(q, w, keys, scales, bt.long(), req, bounds, 32)
    with pytest.raises(SparseRefError, match="queries_per_program"):
        paged_indexer_logits(q, w, keys, scales, bt, req, bounds, 32, queries_per_program=3)
    with pytest.raises(SparseRefError, match="block_t"):
        paged_indexer_logits(q, w, keys, scales, bt, req, bounds, 32, block_t=48)


def test_aot_variants_are_well_formed():
    """Every variant names every kernel argument (the compile itself runs in the AOT test / on the GPU)."""
    import inspect

    for entry in AOT_VARIANTS:
        fn, sig, const = entry[:3]
        params = list(inspect.signature(fn.fn).parameters)
        assert sorted(params) == sorted([*sig, *const]), fn.__name__
        assert sig["q_ptr"] in ("*fp8e4nv", "*fp32")


# ----------------------------------------------------------------------------- the indexer's paths
CFG = IndexerConfig(hidden_size=40, q_lora_rank=24, n_heads=8, head_dim=32, rope_dim=16, index_topk=12)


def setup(page_size, backend, cfg=CFG, seed=0):
    mgr = KVCacheManager.create(max_requests=4, max_context_len=160, num_pages=40, page_size=page_size, device=DEV)
    idx = LightningIndexer(cfg, seed=seed, backend=backend, device=DEV)
    return mgr, idx.attach_cache(IndexerKeyCache.for_manager(mgr, cfg))


def inputs(n, seed, cfg=CFG):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.hidden_size, generator=g).to(DEV), torch.randn(n, cfg.q_lora_rank, generator=g).to(DEV)


def scramble(mgr):
    """Allocate and free some pages so requests get pages in a non-sequential physical order."""
    junk = [mgr.admit(n) for n in (7, 30, 3)]
    for r in junk[::2]:
        mgr.release(r)
    return junk[1]


@pytest.mark.parametrize("page_size", [16, 64])
def test_loop_batched_and_kernel_agree_over_prefill_chunk_and_decode(page_size):
    lengths, prefix, decodes = [70, 1, 20], [50, 0, 20], 2
    results = {}
    for backend in ("loop", "torch", "triton"):
        mgr, idx = setup(page_size, "torch" if backend == "loop" else backend)
        scramble(mgr)
        score = idx.index_scores_loop if backend == "loop" else idx.index_scores
        reqs = [mgr.admit(p) for p in prefix]
        xs = [inputs(n + decodes, 10 + i) for i, n in enumerate(lengths)]
        out = []
        fb = build_extend_batch(mgr, reqs)
        out.append(score(torch.cat([xs[i][0][:p] for i, p in enumerate(prefix)]),
                         torch.cat([xs[i][1][:p] for i, p in enumerate(prefix)]), fb.positions, fb, 0))
        for r, n, p in zip(reqs, lengths, prefix, strict=True):
            mgr.grow(r, n - p)
        fb = build_extend_batch(mgr, reqs, prefix_lens=prefix)  # chunk 2 (request 3: no new tokens)
        out.append(score(torch.cat([xs[i][0][p:n] for i, (n, p) in enumerate(zip(lengths, prefix, strict=True))]),
                         torch.cat([xs[i][1][p:n] for i, (n, p) in enumerate(zip(lengths, prefix, strict=True))]),
                         fb.positions, fb, 0))
        for step in range(decodes):
            fb = decode_step(mgr, reqs)
            x = torch.stack([xs[i][0][n + step] for i, n in enumerate(lengths)])
            ql = torch.stack([xs[i][1][n + step] for i, n in enumerate(lengths)])
            out.append(score(x, ql, fb.positions, fb, 0))
            out.append(idx(x, ql, fb.positions, fb, 0) if backend != "loop" else None)
        results[backend] = out
    for a, b, c in zip(results["loop"], results["torch"], results["triton"], strict=True):
        if a is None:  # a selection: identical between the torch and the Triton paths
            assert torch.equal(b, c) or (ON_GPU and float((b == c).float().mean()) >= 0.9)  # GPU: near-ties
            continue
        assert a.shape == b.shape == c.shape
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)) and torch.equal(finite, torch.isfinite(c))
        close(b.masked_fill(~finite, 0), a.masked_fill(~finite, 0))
        close(c.masked_fill(~finite, 0), a.masked_fill(~finite, 0))


def test_extend_then_decode_equals_one_extend_on_the_kernel_path():
    lengths, decodes = [40, 9], 2
    total = [n + decodes for n in lengths]
    xs = [inputs(n, 20 + i) for i, n in enumerate(total)]
    mgr, idx = setup(16, "triton", seed=3)
    reqs = [mgr.admit(n) for n in total]
    fb = build_extend_batch(mgr, reqs)
    x, ql = torch.cat([a for a, _ in xs]), torch.cat([b for _, b in xs])
    full = idx.index_scores(x, ql, fb.positions, fb, 0)
    full_sel = topk_reference(full, CFG.index_topk, fb.positions + 1, order="index", width=CFG.index_topk)
    mgr2, idx2 = setup(16, "triton", seed=3)
    scramble(mgr2)
    reqs2 = [mgr2.admit(n) for n in lengths]
    fb = build_extend_batch(mgr2, reqs2)
    idx2(torch.cat([xs[i][0][:n] for i, n in enumerate(lengths)]),
         torch.cat([xs[i][1][:n] for i, n in enumerate(lengths)]), fb.positions, fb, 0)
    for step in range(decodes):
        fb = decode_step(mgr2, reqs2)
        pos = [n + step for n in lengths]
        x = torch.stack([xs[i][0][p] for i, p in enumerate(pos)])
        ql = torch.stack([xs[i][1][p] for i, p in enumerate(pos)])
        sel = idx2(x, ql, fb.positions, fb, 0)
        dec = idx2.index_scores_loop(x, ql, fb.positions, fb, 0)
        for i, p in enumerate(pos):
            row = sum(total[:i]) + p
            close(dec[i, : p + 1], full[row, : p + 1])
            assert torch.equal(sel[i], full_sel[row])


def test_chunked_prefill_equals_one_extend_on_the_kernel_path():
    lengths, cut = [30, 5, 1], [17, 0, 1]
    xs = [inputs(n, 30 + i) for i, n in enumerate(lengths)]
    mgr, idx = setup(16, "triton", seed=4)
    reqs = [mgr.admit(n) for n in lengths]
    fb = build_extend_batch(mgr, reqs)
    full = idx(torch.cat([a for a, _ in xs]), torch.cat([b for _, b in xs]), fb.positions, fb, 0)
    mgr2, idx2 = setup(16, "triton", seed=4)
    reqs2 = [mgr2.admit(p) for p in cut]
    fb1 = build_extend_batch(mgr2, reqs2)
    idx2(torch.cat([xs[i][0][:p] for i, p in enumerate(cut)]), torch.cat([xs[i][1][:p] for i, p in enumerate(cut)]),
         fb1.positions, fb1, 0)
    for r, n, p in zip(reqs2, lengths, cut, strict=True):
        mgr2.grow(r, n - p)
    fb2 = build_extend_batch(mgr2, reqs2, prefix_lens=cut)
    chunk = idx2(torch.cat([xs[i][0][p:] for i, p in enumerate(cut)]), torch.cat([xs[i][1][p:] for i, p in
                                                                                 enumerate(cut)]),
                 fb2.positions, fb2, 0)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    want = torch.cat([full[s + p: s + n] for s, n, p in zip(starts, lengths, cut, strict=True)])
    assert torch.equal(chunk, want)


def test_kernel_path_matches_the_full_precision_formula():
    cfg = dataclasses.replace(CFG, use_fp8=False)
    mgr, idx = setup(16, "triton", cfg=cfg, seed=5)
    r = mgr.admit(37)
    fb = build_extend_batch(mgr, [r])
    x, ql = inputs(37, 6, cfg)
    got = idx.index_scores(x, ql, fb.positions, fb, 0)
    qk = idx.prepare(x, ql, fb.positions)
    want = torch.einsum("th,ths->ts", qk.weights, torch.einsum("thd,sd->ths", qk.q, qk.k).clamp_min(0))
    want = want.masked_fill(~torch.ones(37, 37, dtype=torch.bool, device=DEV).tril(), -math.inf)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    close(got.masked_fill(~finite, 0), want.masked_fill(~finite, 0))


def test_scoring_backend_is_checked():
    with pytest.raises(SparseRefError, match="backend"):
        LightningIndexer(CFG, backend="cuda")
    assert not LightningIndexer(CFG).backend.name == "triton" or torch.cuda.is_available()
    assert LightningIndexer(CFG, backend="triton").backend.name == "triton"


# ----------------------------------------------------------------------------- CUDA-graph capture of decode
HOST_OPS = {"aten.lift_fresh.default",  # a tensor made from a host value (x[idx] = True): a CPU->GPU copy
            "aten._local_scalar_dense.default",  # .item() / int(t) / bool(t): a host sync
            "aten.equal.default", "aten.is_nonzero.default", "aten.nonzero.default"}  # host syncs


class _HostOps(TorchDispatchMode):
    """Records every op of ``HOST_OPS``: none may run while a CUDA graph captures."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _decode_setup(backend):
    mgr, idx = setup(16, backend)
    scramble(mgr)
    reqs = [mgr.admit(n) for n in (20, 1, 33)]
    fb = build_extend_batch(mgr, reqs)
    idx(*inputs(54, 40), fb.positions, fb, 0)
    fb = decode_step(mgr, reqs)
    return idx, fb, inputs(3, 41)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_forward_is_capture_safe(backend, monkeypatch):
    """While "capturing", a decode step makes no host sync and no tensor from a host value (on any device).

    A CUDA graph capture refuses both (a CPU->GPU copy of a scalar tensor raised on the H200); the
    checks that need them are skipped while capturing, so pretend to capture and record the ops.
    """
    idx, fb, (x, ql) = _decode_setup(backend)
    eager = idx(x, ql, fb.positions, fb, 0)
    real = checks.capturing
    for name, module in list(sys.modules.items()):
        if name.startswith("sparse_ref") and getattr(module, "capturing", None) is real:
            monkeypatch.setattr(module, "capturing", lambda: True)
    with _HostOps() as ops:
        got = idx(x, ql, fb.positions, fb, 0)
    assert ops.seen == []
    assert torch.equal(got, eager)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_forward_in_a_cuda_graph_equals_eager(backend):
    idx, fb, (x, ql) = _decode_setup(backend)
    eager = idx(x, ql, fb.positions, fb, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        idx(x, ql, fb.positions, fb, 0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = idx(x, ql, fb.positions, fb, 0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_bench_selection_agreement_allows_only_near_ties():
    from sparse_ref.bench.dsa import selections_agree

    scores = torch.tensor([[5.0, 1.0, 3.0, 2.9999, 0.0, -math.inf]])
    best = torch.tensor([[0, 2, -1]])  # k = 2 over a row
    assert selections_agree(best, best, scores, 2, 1e-3)
    assert selections_agree(torch.tensor([[0, 3, -1]]), best, scores, 2, 1e-3)  # 2.9999 ties 3.0 within 1e-3 x 5
    assert not selections_agree(torch.tensor([[0, 1, -1]]), best, scores, 2, 1e-3)  # 1.0 is no near-tie of 3.0
    assert not selections_agree(torch.tensor([[0, 3, -1]]), best, scores, 2, 1e-6)
