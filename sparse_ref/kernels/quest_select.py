"""The decode step's retrieval in ONE launch: Quest page scores, with the page selection and page table as its tail.

``quest_page_scores_from_queries`` (``quest.py``) scores a row's pages in many programs, and
``select_pages_to_table`` (``page_select.py``) then selects the row and writes its page table in one
program per row: two launches. At bs=1 a launch and the gap before it cost microseconds, about what the
selection itself costs, so here the two are one launch:

1. every program scores its ``BLOCK_P`` pages of one row (``quest.score_pages_from_queries``) and stores them;
2. then it adds 1 to its row's arrival counter (``arrival_counters``): the row's LAST program to arrive,
   which sees every other program's scores (the counter's acquire-release order), resets the counter and
   runs ``page_select.select_to_table_row`` on the row: selection, page table, KV length, and, last of all
   rows, the cumulative lengths.

The results equal the two launches' bit for bit (the same device functions on the same scores). The
rows selected while other rows are still being scored overlap with them, but each row's selection is
one program's work: the knob ``TUNING["max_rows"]`` says up to which batch size the decode step takes
this path (``QuestAlgorithm.score_pages_to_table``); larger batches take the two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.kernels import Knob, Knobs, after_previous_launch, arrival_counters, pdl_options
from sparse_ref.kernels.page_select import (
    MAX_REGISTER_PAGES,
    check_select_to_table,
    select_pages_to_table,
    select_to_table_row,
    table_launch_args,
)
from sparse_ref.kernels.quest import (
    block_sizes,
    check_quest_scores_from_queries,
    quest_page_scores_from_queries,
    score_pages_from_queries,
)


@triton.jit
def _quest_select_kernel(q_ptr, page_min_ptr, page_max_ptr, valid_ptr, arrivals,  # the scoring's inputs; counters
                         scores, selected, lengths, seq_lens, sparse_mask, budget, scratch,  # as select_to_table_row
                         rows, req_to_token, page_table, kv_lens, cu_kv_lens, sizes, rules,
                         num_pages, HD, head_dim,
                         GROUP: tl.constexpr, MEAN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_HD: tl.constexpr,
                         N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                         BLOCK_OUT: tl.constexpr, BLOCK_T: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
    """Program (block, r): scores pages ``[block * BLOCK_P, (block + 1) * BLOCK_P)`` of row r; the row's last
    program to finish selects the row and writes its page table (see the module docstring)."""
    after_previous_launch(PDL)
    r = tl.program_id(1)
    max_pages, r2t_rows, r2t_width, page_size = sizes[1], sizes[4], sizes[5], rules[0]
    score_pages_from_queries(q_ptr, page_min_ptr, page_max_ptr, valid_ptr, req_to_token, rows, scores, r.to(tl.int64),
                             tl.program_id(0), max_pages, num_pages, HD, head_dim, r2t_rows, r2t_width, page_size,
                             GROUP, MEAN, BLOCK_P, BLOCK_HD)
    tl.debug_barrier()  # every thread's scores are stored before the counter says "done"
    if tl.atomic_add(arrivals + r, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(arrivals + r, 0)  # reset for the next call
        select_to_table_row(r, tl.num_programs(1), scores, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                            rows, req_to_token, page_table, kv_lens, cu_kv_lens, sizes, rules,
                            N_PAD, G, SLOTS, PAIR, BLOCK_OUT, BLOCK_T, DIRECT)


# Launch knobs: the largest batch the decode step sends here (0: never); warps of the launch (None: the
# selection's, which needs them more than the scoring); programmatic dependent launch. The scoring's blocks are
# quest.TUNING's.
TUNING = Knobs("quest_select", {"max_rows": Knob(0, 65535), "num_warps": Knob(1, 32, pow2=True, none=True),
                                "pdl": Knob(flag=True)}, max_rows=0, num_warps=None, pdl=True)


def quest_select_to_table(queries: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                          page_valid: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          page_size: int, max_pages: int, gqa_mode: str, seq_lens: torch.Tensor,
                          sparse_mask: torch.Tensor, config, *, out=None, check_values: bool = True):
    """``(scores, selected, lengths, page_table, kv_lens, cu_kv_lens)`` in one launch: exactly what
    ``scores = quest_page_scores_from_queries(queries, page_min, page_max, page_valid, req_to_token,
    req_pool_indices, page_size, max_pages, gqa_mode)`` followed by ``select_pages_to_table(scores, seq_lens,
    sparse_mask, page_size, config, req_pool_indices, req_to_token, out=out)`` return.
    ``check_values=False``: the caller checked the index values (the kernel clamps every index it reads)."""
    num_pages, hd, head_dim, group, page_size, max_pages = check_quest_scores_from_queries(
        queries, page_min, page_max, page_valid, req_to_token, req_pool_indices, page_size, max_pages, gqa_mode,
        None, check_values)
    bs, device = req_pool_indices.shape[0], page_min.device
    scores = torch.empty((bs, max_pages), dtype=torch.float32, device=device)
    page_size, W, out_width, shapes = check_select_to_table(
        scores, seq_lens, sparse_mask, page_size, config, req_pool_indices, req_to_token, out, check_values,
        MAX_REGISTER_PAGES)
    if bs == 0 or max_pages == 0:  # nothing to score: the two launchers' own edge cases
        quest_page_scores_from_queries(queries, page_min, page_max, page_valid, req_to_token, req_pool_indices,
                                       page_size, max_pages, gqa_mode, out=scores, check_values=False)
        return scores, *select_pages_to_table(scores, seq_lens, sparse_mask, page_size, config, req_pool_indices,
                                              req_to_token, out=out, check_values=False)
    if out is None:
        out = tuple(torch.empty(shape, dtype=torch.int32, device=device) for shape in shapes)
    selected = torch.empty((bs, W), dtype=torch.int32, device=device)
    lengths = torch.empty((bs,), dtype=torch.int32, device=device)
    tensors, sizes, rules, ce = table_launch_args(scores, selected, lengths, seq_lens, sparse_mask, page_size,
                                                  config, req_pool_indices, req_to_token, out, W, out_width)
    block_p, block_hd, _ = block_sizes(hd, bs, max_pages, device)
    if TUNING["num_warps"] is not None and device.type == "cuda":
        ce["num_warps"] = TUNING["num_warps"]
    _quest_select_kernel[(triton.cdiv(max_pages, block_p), bs)](
        queries.contiguous(), page_min, page_max, page_valid.view(torch.uint8),
        arrival_counters("quest_select", device, bs), *tensors, sizes, rules, num_pages, hd, head_dim, GROUP=group,
        MEAN=gqa_mode == "mean", BLOCK_P=block_p, BLOCK_HD=block_hd, **ce, **pdl_options(device, TUNING["pdl"]))
    return scores, selected, lengths, out[0], out[1], out[2]
