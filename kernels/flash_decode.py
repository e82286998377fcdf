"""Lesson kernels of notebook 09, section 2: paged flash-decode attention, split over the KV length, then merged.

``teaching_decode_split``: one program per (request, KV head, slice) runs an online softmax over its slice
of the request's tokens, read through the page table (``load_kv_block``, ``online_softmax_step``), for the
whole GQA group, and writes the slice's output and log-sum-exp. ``teaching_decode_merge``: one program per
(request, query head) weighs the slices by ``exp(lse - max lse)``. The package's
``sparse_ref.kernels.decode_attention.paged_decode_attention`` is the same design on tensor cores;
``tests/test_lessons.py`` holds the two equal.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_block(k_buf, v_buf, table_row, t, valid, kvh, H_KV, P: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] (fp32) of the row's tokens t, through the page table; 0 where not valid."""
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(table_row + t // P, mask=valid, other=0).to(tl.int64) * P + t % P  # token t's pool slot
    offs, mask = slot[:, None] * (H_KV * D) + kvh * D + d[None, :], valid[:, None] & (d < D)[None, :]
    return (tl.load(k_buf + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(v_buf + offs, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def online_softmax_step(qv, k, v, valid, m, l_sum, acc):
    """Fold one block of keys and values into the running max m, sum l_sum and output acc of every query head."""
    s = tl.where(valid[None, :], tl.sum(qv[:, None, :] * k[None, :, :], axis=2), float("-inf"))  # [G, N]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_sum * alpha + tl.sum(p, axis=1), acc

@triton.jit
def teaching_decode_split(q, k_buf, v_buf, page_table, kv_lens, part_out, part_lse, scale,
                          H_KV, W, P: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program = one (request, KV head, slice): an online softmax over its slice, for the whole GQA group."""
    pid, split = tl.program_id(0), tl.program_id(1)
    r, kvh = pid // H_KV, pid % H_KV
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = r * H_KV * GROUP + kvh * GROUP + g  # the group's query heads, as rows of q [bs * H_q, D]
    qd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
    qv = tl.load(q + heads[:, None] * D + d[None, :], mask=qd_mask, other=0.0).to(tl.float32) * scale
    kv_len = tl.load(kv_lens + r)
    per_split = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N  # whole blocks per slice
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores
    l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of exp(score - m) * v
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_block(k_buf, v_buf, page_table + r * W, t, t < end, kvh, H_KV, P, D, BLOCK_D)
        m, l_sum, acc = online_softmax_step(qv, k, v, t < end, m, l_sum, acc)
    empty = start >= end
    l_safe = tl.where(empty, 1.0, l_sum)
    base = heads * SPLITS + split
    tl.store(part_out + base[:, None] * D + d[None, :], tl.where(empty, 0.0, acc / l_safe[:, None]), mask=qd_mask)
    tl.store(part_lse + base, tl.where(empty, float("-inf"), m + tl.log(l_safe)), mask=g < GROUP)

@triton.jit
def teaching_decode_merge(part_out, part_lse, out, SPLITS: tl.constexpr, D: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program = one (request, query head): the slices' outputs weighted by exp(lse - max lse)."""
    bh = tl.program_id(0).to(tl.int64)
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse + bh * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every slice empty (kv_len 0): any finite shift
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))  # an empty slice weighs 0
    o = tl.load(part_out + (bh * SPLITS + s)[:, None] * D + d[None, :],
                mask=(s < SPLITS)[:, None] & (d < D)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    tl.store(out + bh * D + d, tl.sum(w[:, None] * o, axis=0) / tl.where(total == 0.0, 1.0, total), mask=d < D)

def teaching_decode_attention(q, k_buf, v_buf, page_table, kv_lens, page, splits, block_n=16):
    """fp32 [bs, H_q, D]: the split launch, then the merge launch."""
    bs, hq, d = q.shape
    hkv = k_buf.shape[1]
    part = torch.empty((bs, hq, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((bs, hq, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((bs, hq, d), dtype=torch.float32, device=q.device)
    teaching_decode_split[(bs * hkv, splits)](q.contiguous(), k_buf, v_buf, page_table, kv_lens, part, lse, d ** -0.5,
                                              hkv, page_table.shape[1], P=page, SPLITS=splits, GROUP=hq // hkv, D=d,
                                              BLOCK_G=triton.next_power_of_2(hq // hkv), BLOCK_N=block_n,
                                              BLOCK_D=triton.next_power_of_2(d))
    teaching_decode_merge[(bs * hq,)](part, lse, out, SPLITS=splits, D=d, BLOCK_S=triton.next_power_of_2(splits),
                                      BLOCK_D=triton.next_power_of_2(d))
    return out
