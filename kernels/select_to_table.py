"""Lesson kernel of notebook 09, section 1: page selection and the page table in one launch, one program per request.

``plan_row`` gives a request's windows (sink, history, recent pages) from its ``seq_len`` alone;
``beaten_by`` ranks the history pages exactly by counting, for each page, the candidates that beat it
(a higher score, or an equal one and a lower id); one prefix sum places the kept pages in ascending order,
and the same program writes the request's page-table row from ``req_to_token``. The package's
``sparse_ref.kernels.page_select.select_pages_to_table`` selects by radix windows instead of counting;
``tests/test_lessons.py`` holds the two equal on all five outputs.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def plan_row(seq, on, budget, P: tl.constexpr, RECENT: tl.constexpr, SINK: tl.constexpr, MIN_SEQ: tl.constexpr):
    """The row's windows from its seq_len alone: (n, recent_start, sink_end, k, sparse)."""
    n = (seq + P - 1) // P  # the request's pages
    recent_start = n - tl.minimum(n, RECENT)
    sink_end = tl.minimum(recent_start, SINK)
    k = tl.load(budget + recent_start - sink_end)  # the config's history budget for this many pages
    sparse = on & (seq >= MIN_SEQ) & (n > 0) & (sink_end + k + n - recent_start < n)
    return n, recent_start, sink_end, k, sparse


@triton.jit
def beaten_by(score_row, N, lo, hi, N_PAD: tl.constexpr, BLOCK_J: tl.constexpr):
    """Per page i: how many history candidates in [lo, hi) beat it (a higher score, or equal and a lower id);
    and whether i is a candidate itself (in the history, not NaN, not -inf)."""
    i = tl.arange(0, N_PAD)
    s_i = tl.load(score_row + i, mask=i < N, other=float("nan")) + 0.0  # + 0.0: -0.0 ties +0.0
    beaten = tl.zeros([N_PAD], dtype=tl.int32)
    for j0 in range(0, N, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        s_j = tl.load(score_row + j, mask=j < N, other=float("nan")) + 0.0
        ok_j = (j >= lo) & (j < hi) & (s_j == s_j) & (s_j != float("-inf"))  # s == s: not NaN
        beats = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < i[:, None]))
        beaten += tl.sum((ok_j[None, :] & beats).to(tl.int32), axis=1)
    return beaten, (i >= lo) & (i < hi) & (s_i == s_i) & (s_i != float("-inf"))

@triton.jit
def teaching_select_to_table(scores, seq_lens, sparse_mask, budget, rows, req_to_token,  # inputs
                             selected, lengths, page_table, kv_lens,  # outputs
                             N, W, W_OUT, R2T_W, P: tl.constexpr, RECENT: tl.constexpr, SINK: tl.constexpr,
                             MIN_SEQ: tl.constexpr, N_PAD: tl.constexpr, BLOCK_J: tl.constexpr,
                             BLOCK_OUT: tl.constexpr):
    """One program = one request: its windows, its history top-k, its selection, its page-table row."""
    r = tl.program_id(0)
    seq = tl.load(seq_lens + r)
    n, recent_start, sink_end, k, sparse = plan_row(seq, tl.load(sparse_mask + r) != 0, budget, P, RECENT, SINK,
                                                    MIN_SEQ)
    beaten, ok = beaten_by(scores + r * N, N, sink_end, recent_start, N_PAD, BLOCK_J)
    i, o = tl.arange(0, N_PAD), tl.arange(0, BLOCK_OUT)
    keep = sparse & ((i < sink_end) | (ok & (beaten < k)) | ((i >= recent_start) & (i < n)))
    place = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # ascending ids: the kept pages before it
    length = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(selected + r * W + place, i, mask=keep)
    tl.store(selected + r * W + o, tl.full([BLOCK_OUT], -1, tl.int32), mask=(o >= length) & (o < W))
    # The page table: a sparse row lists its kept pages in order, a dense row all n pages; logical page
    # j is the physical page that holds the request's token j * P.
    listed, at = tl.where(length > 0, keep, i < n), tl.where(length > 0, place, i)
    row = tl.load(rows + r).to(tl.int64)
    physical = tl.load(req_to_token + row * R2T_W + i * P, mask=listed, other=0) // P
    count = tl.where(length > 0, length, n)
    tl.store(page_table + r * W_OUT + at, physical, mask=listed)
    tl.store(page_table + r * W_OUT + o, tl.zeros([BLOCK_OUT], tl.int32), mask=(o >= count) & (o < W_OUT))
    tl.store(lengths + r, length)
    tl.store(kv_lens + r, tl.where(length > 0, (length - 1) * P + seq - (n - 1) * P, seq))

def teaching_page_table(b: dict, page: int, config):
    """(selected, lengths, page_table, kv_lens, cu_kv_lens) from one launch of the teaching kernel.

    ``b``: ``scores`` fp32 ``[bs, pages]``, ``seq_lens`` int32, ``sparse_mask`` bool, ``rows`` int32 (each request's
    req_to_token row), ``req_to_token`` int32; ``config``: a ``sparse_ref.SparseConfig``."""
    scores, r2t = b["scores"].float().contiguous(), b["req_to_token"]
    bs, n = scores.shape
    W = config.selection_width(n)
    w_out = max(W, triton.cdiv(r2t.shape[1], page))
    def new(*shape):
        return torch.empty(shape, dtype=torch.int32, device=scores.device)

    selected, lengths, table, kv_lens = new(bs, W), new(bs), new(bs, w_out), new(bs)
    budget = config.history_budget_tensor(torch.arange(n + 1, device=scores.device)).int()
    teaching_select_to_table[(bs,)](scores, b["seq_lens"], b["sparse_mask"].to(torch.int8), budget, b["rows"], r2t,
                                    selected, lengths, table, kv_lens, n, W, w_out, r2t.shape[1], P=page,
                                    RECENT=config.num_recent_pages, SINK=config.num_sink_pages,
                                    MIN_SEQ=config.min_sparse_seq_len, N_PAD=max(16, triton.next_power_of_2(n)),
                                    BLOCK_J=16, BLOCK_OUT=max(16, triton.next_power_of_2(w_out)))
    cu_kv_lens = torch.cat([kv_lens.new_zeros(1), kv_lens.cumsum(0).int()])
    return selected, lengths, table, kv_lens, cu_kv_lens

