"""Lesson kernel of notebook 06, section 1.3: Quest page scores, one program per (block of pages, request).

The sign split (``q+ . max + q- . min``, summed over every KV head and dim) over one tile holding a whole
``H_kv * D`` row of bounds per page; a page without bounds scores ``-inf``, and a page id is clamped into
the pool, so even a bad page list reads nothing outside it. The package's
``sparse_ref.kernels.quest.quest_page_scores_from_queries`` (what ``QuestAlgorithm`` runs) also does the
sign split and the page mapping in the same launch, walks the row in chunks and takes 16-bit bounds;
``tests/test_lessons.py`` holds the two equal through ``split_query_sign``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def teaching_quest_kernel(q_pos_ptr, q_neg_ptr, min_ptr, max_ptr, valid_ptr, pages_ptr, out_ptr,
                          max_pages, num_pages,
                          HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)                        # the request
    j = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)   # its logical pages handled here
    in_row = j < max_pages
    page = tl.load(pages_ptr + r * max_pages + j, mask=in_row, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)    # never outside the pool
    valid = tl.load(valid_ptr + page, mask=in_row, other=0) != 0
    d = tl.arange(0, HD_PAD)
    in_hd = d < HD
    qp = tl.load(q_pos_ptr + r * HD + d, mask=in_hd, other=0.0)   # [HD_PAD]
    qn = tl.load(q_neg_ptr + r * HD + d, mask=in_hd, other=0.0)
    tile = page[:, None] * HD + d[None, :]                         # [BLOCK_P, HD_PAD] offsets
    read = (in_row & valid)[:, None] & in_hd[None, :]              # pages without bounds: no read
    mx = tl.load(max_ptr + tile, mask=read, other=0.0)
    mn = tl.load(min_ptr + tile, mask=read, other=0.0)
    score = tl.sum(mx * qp[None, :] + mn * qn[None, :], axis=1)    # [BLOCK_P]
    tl.store(out_ptr + r * max_pages + j, tl.where(valid, score, float("-inf")), mask=in_row)

def teaching_quest_scores(q_pos, q_neg, page_min, page_max, page_valid, pages, block_p=None):
    """fp32 ``[bs, max_pages]`` scores of ``pages`` (physical ids, ``[bs, max_pages]``) from the split queries."""
    bs, max_pages = pages.shape
    hd = page_min.shape[1] * page_min.shape[2]
    if block_p is None:  # keep a tile of about 2K values per pool, so it stays in registers
        block_p = min(16, max(1, 2048 // triton.next_power_of_2(hd)))
    out = torch.empty(bs, max_pages, dtype=torch.float32, device=pages.device)
    grid = (triton.cdiv(max_pages, block_p), bs)
    teaching_quest_kernel[grid](q_pos, q_neg, page_min, page_max, page_valid.view(torch.uint8), pages, out,
                                max_pages, page_min.shape[0], HD=hd, HD_PAD=triton.next_power_of_2(hd),
                                BLOCK_P=block_p)
    return out

