"""Lesson kernel of notebook 06, section 2.4: paged FP8 DSA indexer logits, one program per (token, page).

``I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])`` over one page of 64 keys: one FP8
``tl.dot(K_page, Q^T)`` (tokens on M, heads on N), the ReLU, the head weights, a head sum, then the key
scale. The cache holds per page its FP8 keys and then their fp32 scales, passed twice as two views of the
same bytes. The package's ``sparse_ref.kernels.dsa.paged_indexer_logits`` adds the schedule (many pages per
program); ``tests/test_lessons.py`` holds the two equal.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def teaching_dsa_kernel(q_ptr, w_ptr, kv_fp8_ptr, kv_f32_ptr, block_table_ptr, token_req_ptr, bound_ptr, out_ptr,
                        max_pages, num_pages, out_width,
                        PAGE: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)               # the query token
    j = tl.program_id(1)                            # the logical page of its request
    req = tl.load(token_req_ptr + t).to(tl.int64)
    bound = tl.load(bound_ptr + t)                  # positions < bound are visible
    pos = j * PAGE + tl.arange(0, PAGE)             # the page's 64 logical positions
    visible = pos < bound
    page = tl.load(block_table_ptr + req * max_pages + j).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)   # never outside the cache
    tok, d, h = tl.arange(0, PAGE), tl.arange(0, D), tl.arange(0, H)
    page_bytes = PAGE * (D + 4)
    k = tl.load(kv_fp8_ptr + page * page_bytes + tok[:, None] * D + d[None, :],      # [PAGE, D] fp8
                mask=visible[:, None], other=0.0)
    k_scale = tl.load(kv_f32_ptr + page * (page_bytes // 4) + (PAGE * D) // 4 + tok,  # [PAGE] fp32
                      mask=visible, other=0.0)
    q = tl.load(q_ptr + t * H * D + h[:, None] * D + d[None, :])                      # [H, D] fp8
    w = tl.load(w_ptr + t * H + h)                                                     # [H] fp32
    s = tl.dot(k, tl.trans(q))                                # [PAGE, H] fp32: tokens on M, heads on N
    logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * k_scale   # head sum, then the scale
    tl.store(out_ptr + t * out_width + pos, tl.where(visible, logit, float("-inf")))

def teaching_dsa_logits(q8, w, kv_buf, block_table, token_req, bound, page_size=64):
    """fp32 ``[T, max_pages * page_size]`` logits, -inf past each token's bound (see the kernel).

    ``q8``: FP8 ``[T, H, D]``; ``w``: fp32 ``[T, H]``; ``kv_buf``: uint8 ``[num_pages, page_size * (D + 4)]``
    (each page's FP8 keys, then its fp32 scales); ``block_table``: int32 ``[bs, max_pages]``; ``token_req``
    and ``bound``: int32 ``[T]`` (each token's request, and how many positions it sees)."""
    T, H, D = q8.shape
    max_pages = block_table.shape[1]
    out = torch.empty(T, max_pages * page_size, dtype=torch.float32, device=q8.device)
    teaching_dsa_kernel[(T, max_pages)](q8, w, kv_buf.view(torch.float8_e4m3fn), kv_buf.view(torch.float32),
                                        block_table, token_req, bound, out, max_pages, kv_buf.shape[0], out.shape[1],
                                        PAGE=page_size, D=D, H=H)
    return out
