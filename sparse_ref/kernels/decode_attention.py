"""Paged decode attention in Triton (flash-decoding): one query token per request, K/V read through a page table.

``paged_decode_attention`` computes what ``sparse_ref.attention.sparse_decode_attention`` computes: softmax
attention of ``q`` ``[bs, H_q, D]`` over the first ``kv_lens[r]`` tokens of the physical pages listed in
``page_table[r]`` (token ``t`` of the row lives at slot ``page_table[r, t // P] * P + t % P`` of the
``[num_slots, H_kv, D]`` K/V buffers). The same kernel serves the dense step (the table lists every page of the
request) and the sparse step (the selected pages), so the speed of the two is compared on equal terms.

Two launches:

1. **split kernel**, grid ``(bs * H_kv, num_splits)``. A program takes one request, one KV head and one slice of
   the row's KV length (the length is split evenly among ``num_splits`` programs, in blocks of ``BLOCK_N`` tokens,
   from ``kv_lens`` read on the device: no host sync). It handles the whole GQA group of that KV head (query heads
   ``kvh * G .. kvh * G + G - 1``), so each K/V byte is read once. Online softmax in fp32 (running max, running
   sum, rescaled accumulator). It writes the slice's normalized output and its log-sum-exp.
2. **merge kernel**, grid ``(bs * H_q,)``: ``out = sum_s w_s o_s / sum_s w_s`` with ``w_s = exp(lse_s - max
   lse)``. With one split the split kernel writes ``out`` directly and the merge is skipped.

Two ways to form ``q . k`` and ``p . v`` (``USE_DOT``):

* ``tl.dot`` over the GQA group padded to 16 rows (tensor cores). With 16-bit K/V the fp32 query (and the fp32
  probabilities) are split into a high and a low 16-bit part (``PRECISE``), so the result keeps ~16 mantissa bits
  instead of 8: K/V are exact in 16 bits, only q and p would be rounded. When the group fits half the 16 rows
  (``PACKED``: groups up to 8) both parts go into one dot, the high parts in the first half of the rows and the
  low ones in the second, and the two halves of the result are summed; larger groups take two dots each. With fp32
  K/V (and always under Triton's interpreter, whose bf16 ``tl.dot`` is wrong) the operands stay fp32
  (``FP32_DOT``, IEEE precision, no TF32).
* broadcast multiply + sum in fp32 (``q[:, None, :] * k[None, :, :]``): a launch knob (``TUNING["use_dot"] =
  False``). On an H200 the tensor-core path wins even for MHA (one query head padded to 16 rows: 227 µs against
  328 µs at bs=1, 32 heads, 32K tokens), so it is the default for every group size.

Offload (``ready``): the swap-in's copies may still be landing in the hot buffer when this launch starts (PDL
places its programs once every copy program runs); each program waits only for the flags of its own chunks of
table entries, so attention overlaps the PCIe copies. Table, order and result are the plain ones.

Edge cases: a row with ``kv_len == 0`` returns zeros (like the reference); a NaN in the query
gives NaN (it is never turned into 0). Page ids are clamped into the pool and lengths into
``[0, W * P]`` inside the kernel, so even unchecked values (during CUDA-graph capture, when the
launcher's value checks are skipped) never read outside the buffers. Nothing is read back to
the host: the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    FLOAT_DTYPES,
    check_float,
    check_int,
    check_kernel_device,
    check_range,
    check_same_device,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.device import triton_interpreted
from sparse_ref.errors import ShapeError
from sparse_ref.kernels import Knob, Knobs, after_previous_launch, pdl_options

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr,  # queries [bs, H_q, D]; the layer's K and V [slots, H_kv, D]
                         page_table_ptr, kv_lens_ptr,  # pages and KV length per request
                         ready_ptr,  # WAIT: int32 [bs, chunks], 0 once a chunk of table entries landed (< 0 before)
                         part_out_ptr, part_lse_ptr,  # per split: outputs and log-sum-exps (the merge's inputs)
                         sm_scale,  # the softmax scale
                         dims,  # (KV heads, table width W, page size, pages, splits per row, flags per row, chunk)
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr,
                         FP32_DOT: tl.constexpr, PRECISE: tl.constexpr, PACKED: tl.constexpr, WAIT: tl.constexpr,
                         PDL: tl.constexpr):
    """One program = one (request, KV head, split): its slice of the KV length for the whole GQA group;
    writes the group's partial outputs and log-sum-exps for the merge."""
    if WAIT:  # the launch before copies K/V in: the flags below say when (its table was written before it)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
    else:
        after_previous_launch(PDL)  # (the page table and lengths come from the launch before)
    num_kv_heads, width, page_size, num_pages, num_splits = dims[0], dims[1], dims[2], dims[3], dims[4]
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row = pid // num_kv_heads
    kvh = pid % num_kv_heads
    num_q_heads = num_kv_heads * GROUP

    # ROWS query rows: the group padded to BLOCK_G (tl.dot's 16 rows), or, PACKED, to BLOCK_G // 2: the dots'
    # rows [0, ROWS) then carry the high 16-bit halves and rows [ROWS, BLOCK_G) the low ones (below)
    ROWS: tl.constexpr = BLOCK_G // 2 if PACKED else BLOCK_G
    g = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    in_g = g < GROUP
    in_d = d < HEAD_DIM
    heads = kvh * GROUP + g  # the query heads of this KV head's group
    scale = sm_scale * 1.4426950408889634  # fold the scale and log2(e) in: softmax with exp2
    if PACKED:  # each query row twice: its high 16-bit half in row r, the rest in row ROWS + r
        r = tl.arange(0, BLOCK_G)
        q_offs = (row * num_q_heads + kvh * GROUP + r % ROWS)[:, None].to(tl.int64) * HEAD_DIM + d[None, :]
        q2 = tl.load(q_ptr + q_offs, mask=((r % ROWS) < GROUP)[:, None] & in_d[None, :], other=0.0)
        q2 = q2.to(tl.float32) * scale
        q2_hi = q2.to(k_ptr.dtype.element_ty)
        q_pack = tl.where((r < ROWS)[:, None], q2_hi, (q2 - q2_hi.to(tl.float32)).to(k_ptr.dtype.element_ty))
    else:
        q_offs = (row * num_q_heads + heads)[:, None].to(tl.int64) * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=in_g[:, None] & in_d[None, :], other=0.0).to(tl.float32) * scale

    kv_len = tl.load(kv_lens_ptr + row)
    kv_len = tl.minimum(tl.maximum(kv_len, 0), width * page_size)  # never past the table
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    if WAIT:
        _await_chunks(ready_ptr + row.to(tl.int64) * dims[5], start // dims[6],
                      tl.minimum(tl.cdiv(end, dims[6]), dims[5]))

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    row_stride = num_kv_heads * HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        valid = t < end
        page = tl.load(page_table_ptr + row.to(tl.int64) * width + t // page_size, mask=valid, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)  # never outside the pool
        slot = page * page_size + t % page_size
        kv_offs = slot[:, None] * row_stride + kvh * HEAD_DIM + d[None, :]
        kv_mask = valid[:, None] & in_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if PACKED:  # one dot: rows r and ROWS + r are the two halves of q_r . k, summed in fp32
            qk = tl.sum(tl.reshape(tl.dot(q_pack, tl.trans(k)), [2, ROWS, BLOCK_N]), axis=0)
        elif USE_DOT:
            if FP32_DOT:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                q_hi = q.to(k.dtype)
                qk = tl.dot(q_hi, tl.trans(k))
                if PRECISE:
                    qk += tl.dot((q - q_hi.to(tl.float32)).to(k.dtype), tl.trans(k))
        else:
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PACKED:  # the same for p . v: p's high halves in rows [0, ROWS), the rest below them
            p_hi = p.to(v.dtype)
            p_pack = tl.reshape(tl.permute(tl.join(p_hi, (p - p_hi.to(tl.float32)).to(v.dtype)), (2, 0, 1)),
                                [BLOCK_G, BLOCK_N])
            pv = tl.sum(tl.reshape(tl.dot(p_pack, v), [2, ROWS, BLOCK_D]), axis=0)
        elif USE_DOT:
            if FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                p_hi = p.to(v.dtype)
                pv = tl.dot(p_hi, v)
                if PRECISE:
                    pv += tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    empty = start >= end  # nothing to read in this slice (or the whole row is empty)
    l_safe = tl.where(empty, 1.0, l_i)  # l_i > 0 once a token was read (or NaN, from a NaN query: kept)
    out = tl.where(empty, 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    base = (row * num_q_heads + heads).to(tl.int64) * num_splits + split
    tl.store(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :], out, mask=in_g[:, None] & in_d[None, :])
    tl.store(part_lse_ptr + base, lse, mask=in_g)
    if WAIT:  # every chunk awaited by one program at least: the launch ends after the copies
        _await_chunks(ready_ptr + row.to(tl.int64) * dims[5], 0, tl.where((kvh == 0) & (split == 0), dims[5], 0))


@triton.jit
def _await_chunks(flags, first, last):
    """Spin until the flags ``[first, last)`` of a row reach 0 (the copy programs count up to it, with release)."""
    for c in range(first, last):
        while tl.load(flags + c, volatile=True) < 0:  # plain reads while it waits (no read-modify-write traffic)
            pass
        tl.atomic_add(flags + c, 0, sem="acquire")  # then one acquire: the copies' stores are seen


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program = one (request, query head): its partial outputs merged by their log-sum-exps."""
    after_previous_launch(PDL)
    bh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    in_s = s < num_splits
    in_d = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + bh * num_splits + s, mask=in_s, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every slice empty: any finite shift will do
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))  # empty slices weigh 0; NaN stays NaN
    o = tl.load(part_out_ptr + (bh * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                mask=in_s[:, None] & in_d[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total == 0.0, 1.0, total)  # all empty (kv_len 0): zeros
    tl.store(out_ptr + bh * HEAD_DIM + d, out, mask=in_d)


# ------------------------------------------------------------------------------------------
# Launch configuration
# ------------------------------------------------------------------------------------------
MAX_SPLITS = 64
# Launch knobs (None: the default the launcher picks from the shapes). Benchmarks and tests vary them with
# ``sparse_ref.kernels.tuning(TUNING, ...)``: splits of the KV length per (request, KV head); tokens per step;
# warps; pipeline stages; tl.dot (tensor cores) or broadcast products; two-term 16-bit dots. Both launches use
# programmatic dependent launch where the GPU has it (their programs are placed while the launch before finishes).
TUNING = Knobs("decode_attention", {
    "num_splits": Knob(1, MAX_SPLITS, none=True), "block_n": Knob(16, 1024, pow2=True, none=True),
    "num_warps": Knob(1, 32, pow2=True, none=True), "num_stages": Knob(1, 8, none=True),
    "use_dot": Knob(flag=True, none=True), "precise": Knob(flag=True),
}, num_splits=None, block_n=None, num_warps=None, num_stages=None, use_dot=None, precise=True)
DOT_MIN_GROUP = 1  # GQA groups of at least this many query heads use tl.dot (padded to 16 rows): all of them
PACK_HALVES = True  # both 16-bit parts in one dot where the group fits half the rows (H200 bs=64 32K: 2261 -> 2061 us)
# KV tokens per split from which 16-bit tensor-core launches take the long-split tile: GQA 128 tokens a step and 2
# pipeline stages, MHA 64 tokens (see launch_config)
LONG_SPLIT_GQA, LONG_SPLIT_MHA = 4096, 512
PROGRAMS_PER_SM = 8  # split-kernel programs per SM the default split count aims for


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_target(device: torch.device) -> int:
    """How many split-kernel programs fill the device: ``PROGRAMS_PER_SM`` per SM (4 on CPU, where it does not matter).

    Decode attention is bound by memory latency when few programs run: at bs=1 (32 KV heads) the
    KV length is split so that every SM holds several programs with loads in flight.
    """
    if device.type != "cuda":
        return 4
    return PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(bs: int, num_kv_heads: int, max_kv_len: int, block_n: int, device: torch.device,
                      long_split: int = 0) -> int:
    """Splits per (request, KV head) from shapes only (never from ``kv_lens`` values: no host sync).

    About ``PROGRAMS_PER_SM`` programs per SM (many splits at bs=1, a few at bs=64), at most one per
    ``block_n`` tokens of the static bound ``max_kv_len = W * P``, at most ``MAX_SPLITS``. Short splits round
    down, so no last wave runs nearly empty; splits of at least ``long_split`` tokens (the long-split tile: fewer
    programs fit an SM, and more of them hide latency) round up; rows shorter than that tile are not split once
    the requests give every SM two programs (no merge launch). The A/Bs behind each rule: ``docs/performance.md``,
    "Attention at five shapes beside cuDNN".
    """
    base, target = max(1, bs * num_kv_heads), programs_target(device)
    want = triton.cdiv(target, base)
    if not (long_split and triton.cdiv(max(max_kv_len, 1), want) >= long_split):
        want = max(1, target // base)
    if long_split and max_kv_len < long_split and base >= 2 * target // PROGRAMS_PER_SM:
        want = 1  # short rows and every SM holding two programs already: no split, and no merge launch
    return max(1, min(want, triton.cdiv(max(max_kv_len, 1), block_n), MAX_SPLITS))


def launch_config(group: int, head_dim: int, kv_dtype: torch.dtype, interpreted: bool,
                  use_dot: bool | None = None, block_n: int | None = None, num_warps: int | None = None,
                  precise: bool = True, num_stages: int | None = None, split_len: int = 0) -> dict:
    """The constexprs and launch options of the split kernel for a GQA group size, head dim and K/V dtype, and
    ``split_len``, the KV tokens one program walks (0: short; it picks the default tile)."""
    use_dot = group >= DOT_MIN_GROUP if use_dot is None else use_dot
    fp32_dot = bool(use_dot and (interpreted or kv_dtype == torch.float32))
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(max(head_dim, 16 if use_dot else 1))
    big = group >= 2 and not fp32_dot
    if block_n is None and use_dot and not fp32_dot and split_len >= (LONG_SPLIT_GQA if big else LONG_SPLIT_MHA):
        # long splits: 128 tokens and 2 stages for GQA, 64 tokens for MHA (the A/Bs: docs/performance.md)
        block_n = 128 if big else 64
        num_stages = 2 if big and num_stages is None else num_stages
    if block_n is None:
        # broadcast path: the [BLOCK_G, BLOCK_N, BLOCK_D] product near 8K fp32 values; tensor cores: 64 tokens a
        # step for GQA over 16-bit K/V, 32 for MHA and for fp32 K/V (64 spills registers; A/Bs: performance.md)
        block_n = (64 if big else 32) if use_dot else max(16, min(64, 8192 // (block_g * block_d)))
    if num_warps is None:
        num_warps = 4
    # two-term dots in one when the group fits half the padded rows
    packed = bool(PACK_HALVES and use_dot and precise and not fp32_dot and 2 * group <= block_g)
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages is not None else {})}
    return dict(constexprs=dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
                                USE_DOT=bool(use_dot), FP32_DOT=fp32_dot, PRECISE=bool(precise and not fp32_dot),
                                PACKED=packed),
                options=options)


# ------------------------------------------------------------------------------------------
# Public launcher
# ------------------------------------------------------------------------------------------
def paged_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, *,
                           scale: float | None = None, out: torch.Tensor | None = None,
                           ready: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """fp32 ``[bs, H_q, D]``: attention over the first ``kv_lens[r]`` tokens of the pages in ``page_table[r]``.

    Equals ``sparse_decode_attention(q, k_buffer, v_buffer, page_table, kv_lens, page_size, scale)``
    (see the module docstring). ``q`` ``[bs, H_q, D]`` fp32/bf16/fp16; ``k_buffer``/``v_buffer``
    ``[num_slots, H_kv, D]`` (same dtype: fp32/bf16/fp16, contiguous); ``page_table`` int32
    ``[bs, W]`` physical pages in ``[0, num_slots // P)``; ``kv_lens`` int32 ``[bs]`` in
    ``[0, W * P]``. ``scale`` defaults to ``1 / sqrt(D)``. ``out``: fp32 ``[bs, H_q, D]`` buffer.
    ``ready``: ``(flags, chunk)``, the offload's int32 ``[>= bs, n]`` flags of ``chunk`` table entries each,
    negative until the swap-in's copies of the chunk landed: each program waits for its own entries' flags, not for
    the launch before.
    Launch knobs (splits, tile, warps, dot path) are in ``TUNING``.
    """
    page_size, scale, num_pages = check_decode_attention(q, k_buffer, v_buffer, page_table, kv_lens,
                                                                page_size, scale, out, ready)
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads, width = k_buffer.shape[1], page_table.shape[1]
    interpreted = triton_interpreted()
    if out is None:
        out = torch.empty((bs, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    if bs == 0:
        return out
    group = num_q_heads // num_kv_heads
    config = functools.partial(launch_config, group, head_dim, k_buffer.dtype, interpreted, TUNING["use_dot"],
                               TUNING["block_n"], TUNING["num_warps"], TUNING["precise"], TUNING["num_stages"])
    num_splits = TUNING["num_splits"]
    if num_splits is None:  # (from the short-split tile; only a cap of one split per tile of tokens depends on it)
        short = config()
        long_split = 0 if config(split_len=1 << 30) == short else LONG_SPLIT_GQA if group >= 2 else LONG_SPLIT_MHA
        num_splits = choose_num_splits(bs, num_kv_heads, width * page_size, short["constexprs"]["BLOCK_N"],
                                       q.device, long_split)
    cfg = config(split_len=triton.cdiv(width * page_size, num_splits))
    ce = cfg["constexprs"]
    q = q.contiguous()
    pdl = pdl_options(q.device)
    lse = torch.empty((bs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    part = out if num_splits == 1 else torch.empty((bs, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                                                   device=q.device)
    flags, chunk = ready or (kv_lens.view(1, -1), 1)  # (not read without ready)
    _decode_split_kernel[(bs * num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, page_table, kv_lens, flags, part, lse, scale,
        (num_kv_heads, width, page_size, num_pages, num_splits, flags.shape[1], chunk), **ce, WAIT=ready is not None,
        **cfg["options"], **pdl)
    if num_splits > 1:
        _decode_merge_kernel[(bs * num_q_heads,)](part, lse, out, num_splits, HEAD_DIM=head_dim,
                                                  BLOCK_S=triton.next_power_of_2(num_splits),
                                                  BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4, **pdl)
    return out


# ------------------------------ argument checks (each entry point above calls one first)
def check_decode_attention(q, k_buffer, v_buffer, page_table, kv_lens, page_size, scale, out, ready=None):
    """``(page_size, scale, num_pages)`` of ``paged_decode_attention``."""
    fn = "paged_decode_attention"
    check_tensor("q", q, dtype=FLOAT_DTYPES, dims=3, fix="pass one query token per request, [bs, H_q, D].")
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, dims=3, contiguous=True,
                 fix="pass the layer's key buffer of the KV pool, [num_slots, H_kv, D].")
    check_tensor("v_buffer", v_buffer, dtype=k_buffer.dtype, shape=tuple(k_buffer.shape), contiguous=True,
                 fix="pass the layer's value buffer: same shape and dtype as k_buffer.")
    bs, num_q_heads, head_dim = q.shape
    num_slots, num_kv_heads, kv_dim = k_buffer.shape
    if kv_dim != head_dim:
        fail("q", f"head dim {kv_dim} (the KV buffers' head dim)", f"shape {tuple(q.shape)}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        fail("q", f"a multiple of the {num_kv_heads} KV heads as query heads (GQA)", f"{num_q_heads} query heads",
             "pass all query heads of the layer.")
    if head_dim == 0:
        fail("q", "a head dim >= 1", f"shape {tuple(q.shape)}")
    check_tensor("page_table", page_table, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass the page_table of adaptor.to_attention_metadata (int32 [bs, W]).")
    check_tensor("kv_lens", kv_lens, dtype=torch.int32, shape=(bs,), contiguous=True,
                 fix="pass the kv_lens of adaptor.to_attention_metadata (int32, one per request).")
    if page_table.shape[0] != bs:
        fail("page_table", f"{bs} rows (one per query)", f"shape {tuple(page_table.shape)}")
    page_size = check_int("page_size", page_size, low=1, error=ShapeError, fix="pass the KV pool's page size.")
    if num_slots % page_size or num_slots == 0:
        fail("k_buffer", f"a whole number (>= 1) of pages of {page_size} slots", f"{num_slots} slots",
             "pass the buffer of a pool created with this page_size.")
    num_pages = num_slots // page_size
    width = page_table.shape[1]
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(bs, num_q_heads, head_dim), contiguous=True,
                     fix="pass torch.empty(bs, H_q, D, dtype=torch.float32) on the device of q.")
    if ready is not None:
        fix = "pass OffloadedKV.ready (the hot buffer's flags and their chunk), or None."
        if not isinstance(ready, tuple) or len(ready) != 2:
            fail("ready", "a tuple (flags, chunk)", describe(ready), fix)
        flags = check_tensor("ready flags", ready[0], dtype=torch.int32, shape=(None, None), contiguous=True, fix=fix)
        if flags.shape[0] < bs or flags.shape[1] == 0:
            fail("ready flags", f"a row per request ({bs}) at least, and a flag", f"shape {tuple(flags.shape)}", fix)
        check_int("ready chunk", ready[1], low=1, high=1 << 30, error=ShapeError, fix=fix)
    check_same_device(fn, "q", {"q": q, "k_buffer": k_buffer, "v_buffer": v_buffer, "page_table": page_table,
                                "kv_lens": kv_lens, "out": out, "ready flags": ready and ready[0]})
    check_kernel_device(f"{fn}: q", q, "move the tensors to the GPU, or use sparse_ref.attention."
                        "sparse_decode_attention on CPU.")
    scale = 1.0 / head_dim ** 0.5 if scale is None else check_float("scale", scale, error=ShapeError)
    if width * page_size >= 2**31:
        fail("page_table", "W * page_size < 2**31", f"W={width}, page_size={page_size}")
    # value checks (host syncs; skipped while a CUDA graph captures: the kernel clamps instead)
    check_range("page_table", page_table, 0, num_pages - 1,
                "entries past a row's pages must be the padding page 0; every id must name a page of the pool.")
    check_range("kv_lens", kv_lens, 0, width * page_size,
                f"kv_lens[r] counts tokens of the row's {width} table entries of {page_size} slots.")
    return page_size, scale, num_pages
