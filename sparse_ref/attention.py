"""Paged decode attention references, dense and sparse, in fp32 torch (one query token per request).

``dense_decode_attention`` reads every token ``t < seq_len`` through req_to_token (the ground truth);
``sparse_decode_attention`` the first ``kv_len`` tokens of a page table's pages (``adaptor``). Query head
``h`` reads KV head ``h // (H_q / H_kv)``. Both can return the probabilities (``metrics`` measures the mass
a selection keeps); with a table of all pages the two agree to fp32 rounding.
"""
from __future__ import annotations

import math

import torch

from sparse_ref.backend import torch_twin
from sparse_ref.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    INT32_MAX,
    check_float,
    check_int,
    check_range,
    check_rows,
    check_tensor,
    fail,
)
from sparse_ref.errors import ShapeError


def _attend(q: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, k_buffer: torch.Tensor,
            v_buffer: torch.Tensor, group: int, scale: float | None):
    """Softmax attention of ``q`` over the slots ``[bs, T]`` where ``valid``; fp32 output and probabilities.

    A row with nothing to read attends to nothing (zeros); a NaN query or an inf key gives NaN, as it should.
    """
    bs, h_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keys = k_buffer[slots.long()].float()  # [bs, T, H_kv, D]
    values = v_buffer[slots.long()].float()
    q_groups = q.float().reshape(bs, h_q // group, group, d)  # query head h reads KV head h // group
    logits = torch.einsum("bkgd,btkd->bkgt", q_groups, keys).reshape(bs, h_q, -1) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    empty = ~valid.any(dim=1)  # only these rows may become zeros; any other NaN is real
    probs = probs.masked_fill(empty[:, None, None], 0.0)
    out = torch.einsum("bkgt,btkd->bkgd", probs.reshape(bs, h_q // group, group, -1), values)
    return out.reshape(bs, h_q, d), probs


def dense_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, return_probs: bool = False):
    """Attention over every token ``t < seq_len`` of each request. ``probs``: ``[bs, H_q, T]`` over logical t.

    ``T`` is the longest ``seq_len`` in the batch; probabilities past a row's length are 0. Every
    token read must hold a real slot (not padding slot 0, inside the KV buffers).
    """
    group, scale = check_dense_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                                scale)
    longest = int(seq_lens.max()) if q.shape[0] else 0
    t = torch.arange(longest, device=q.device)
    slots = req_to_token[req_pool_indices.long()[:, None], t[None, :]]
    valid = t[None, :] < seq_lens[:, None]
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    out, probs = _attend(q, slots, valid, k_buffer, v_buffer, group, scale)
    return (out, probs) if return_probs else out


@torch_twin("attention")
def sparse_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                            scale: float | None = None, return_probs: bool = False, ready=None):
    """Attention over the first ``kv_len`` tokens of the pages in ``page_table`` ``[bs, W]`` (physical ids).
    (``ready``: the kernel's offload flags; torch runs in stream order and waits for nothing.)

    ``probs``: ``[bs, H_q, W * P]``, position ``i * P + o`` is offset ``o`` of the table's ``i``-th page.
    """
    group, page_size, scale = check_sparse_attention(q, k_buffer, v_buffer, page_table, kv_lens, page_size,
                                                            scale)
    bs, width = q.shape[0], page_table.shape[1]
    offsets = torch.arange(page_size, device=q.device)
    slots = (page_table.long()[:, :, None] * page_size + offsets).reshape(bs, width * page_size)
    valid = torch.arange(width * page_size, device=q.device)[None, :] < kv_lens[:, None]
    out, probs = _attend(q, slots, valid, k_buffer, v_buffer, group, scale)
    return (out, probs) if return_probs else out


# ------------------------------ argument checks (each entry point above calls one first)
def _check_q_kv(q, k_buffer, v_buffer) -> int:
    """Shape checks shared by both attention references; returns the GQA group size ``H_q / H_kv``."""
    check_tensor("q", q, dtype=FLOAT_DTYPES, dims=3, fix="pass one query token per request, [bs, H_q, D].")
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, dims=3, device=q.device)
    check_tensor("v_buffer", v_buffer, dtype=FLOAT_DTYPES, shape=tuple(k_buffer.shape), device=q.device)
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k_buffer.shape[1]
    if k_buffer.shape[2] != d:
        raise ShapeError(f"q: head dim {d} differs from the KV buffers' head dim {k_buffer.shape[2]}.")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ShapeError(f"q: {h_q} query heads are not a multiple of the {h_kv} KV heads (GQA needs H_q % H_kv == 0).")
    return h_q // h_kv


def check_dense_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale):
    """``(group, scale)``; every token read is a real slot (not padding slot 0, inside the KV buffers)."""
    group = _check_q_kv(q, k_buffer, v_buffer)
    bs = q.shape[0]
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, device=q.device)
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, dims=1, device=q.device)
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, dims=1, device=q.device)
    check_rows("seq_lens", seq_lens, bs, "one per query")
    check_rows("req_pool_indices", req_pool_indices, bs, "one per query")
    check_range("seq_lens", seq_lens, 0, req_to_token.shape[1])
    check_range("req_pool_indices", req_pool_indices, 0, req_to_token.shape[0] - 1, "negative rows do not wrap.")
    longest = int(seq_lens.max()) if bs else 0
    t = torch.arange(longest, device=q.device)
    slots = req_to_token[req_pool_indices.long()[:, None], t[None, :]]
    valid = t[None, :] < seq_lens[:, None]
    real = (slots > 0) & (slots < k_buffer.shape[0])
    if bool((valid & ~real).any()):
        r, tok = (int(x) for x in (valid & ~real).nonzero()[0])
        fail("seq_lens", "lengths within each request's tokens (slots in [1, num_slots))",
             f"row {r} token {tok} at slot {int(slots[r, tok])}", "pass the seq_lens of these requests.")
    return group, None if scale is None else check_float("scale", scale, error=ShapeError)


def check_sparse_attention(q, k_buffer, v_buffer, page_table, kv_lens, page_size, scale):
    """``(group, page_size, scale)`` of the sparse attention reference."""
    group = _check_q_kv(q, k_buffer, v_buffer)
    bs = q.shape[0]
    check_tensor("page_table", page_table, dtype=INDEX_DTYPES, dims=2, device=q.device)
    check_tensor("kv_lens", kv_lens, dtype=INDEX_DTYPES, dims=1, device=q.device)
    check_rows("page_table", page_table, bs, "one per query")
    check_rows("kv_lens", kv_lens, bs, "one per query")
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    width = page_table.shape[1]
    check_range("kv_lens", kv_lens, 0, width * page_size, "at most the table's width x page size.")
    check_range("page_table", page_table, 0, k_buffer.shape[0] // page_size - 1, "physical pages of the KV buffers.")
    return group, page_size, None if scale is None else check_float("scale", scale, error=ShapeError)
