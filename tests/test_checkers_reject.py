"""Every exercise checker rejects plausible wrong solutions, with a message that names the case.

For each exercise of the notebooks, two mistakes a student could make (an off-by-one, a forgotten clamp, a
rule applied to the wrong axis, NaN or ties ignored, pages assumed contiguous, a linear hash). Each must fail
its checker with an ``AssertionError`` whose message says which case and what came back, not a bare
"Tensor-likes are not close". (The Triton exercises' own mistakes are in ``test_exercises.py``.)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from test_exercises import PUZZLES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "notebooks"))

import checkers  # noqa: E402

from sparse_ref.fp8 import quantize_fp8  # noqa: E402
from sparse_ref.rope import apply_rope  # noqa: E402
from sparse_ref.selection import select_pages, topk_reference  # noqa: E402


def cdiv(a, b):
    return -(-a // b)


def keys_of(x):
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def _topk_prefix(scores, seq_lens, k, ok_extra=None, descending_ties_high=False):
    n = scores.shape[1]
    ok = torch.arange(n)[None] < seq_lens[:, None]
    if ok_extra is not None:
        ok &= ok_extra
    s = scores.masked_fill(~ok, float("-inf"))
    if descending_ties_high:
        s = s.flip(1)
    order = torch.argsort(s, dim=1, descending=True, stable=True)[:, :k]
    if descending_ties_high:
        order = n - 1 - order
    ids = torch.where(ok.gather(1, order), order, torch.full_like(order, n)).sort(1).values
    ids = torch.where(ids == n, -1, ids)
    return torch.nn.functional.pad(ids, (0, k - ids.shape[1]), value=-1)


WRONG = {
    "check_tokens_read": [
        ("every kept page counted as full", lambda kept, seq_len, P: len(kept) * P),
        ("the partial page off by one", lambda kept, seq_len, P: sum(min(P, seq_len - p * P - 1) for p in kept)),
    ],
    "check_history_pages": [
        ("the sink ignored", lambda n, s, r: range(0, n - min(n, r))),
        ("the first recent page taken as history", lambda n, s, r: range(min(s, n - min(n, r)),
                                                                          n - min(n, r) + (n > r))),
        ("recent not limited by the pages", lambda n, s, r: range(min(s, max(n - r, 0)), max(n - r, 0) - 1)),
    ],
    "check_row_slots": [
        ("pages assumed contiguous", lambda pages, tokens, P: [pages[0] * P + t for t in range(tokens)]),
        ("no offset inside the page", lambda pages, tokens, P: [pages[t // P] * P for t in range(tokens)]),
    ],
    "check_pages_needed": [
        ("the last page's room ignored", lambda seq_len, owned, extra, P: cdiv(extra, P)),
        ("the pages owned ignored", lambda seq_len, owned, extra, P: cdiv(seq_len + extra, P) if extra else 0),
    ],
    "check_searchable": [
        ("<= instead of <", lambda s, w: torch.arange(w)[None] <= s[:, None]),
        ("ints, not bools", lambda s, w: (torch.arange(w)[None] < s[:, None]).int()),
    ],
    "check_topk_in_prefix": [
        ("NaN and -inf not excluded", lambda s, lens, k: _topk_prefix(s, lens, k)),
        ("ties to the higher id", lambda s, lens, k: _topk_prefix(s, lens, k, (s == s) & (s != float("-inf")),
                                                                  descending_ties_high=True)),
    ],
    "check_quest_bound_batch": [
        ("the sign ignored (q . max)", lambda q, lo, hi: q @ hi.T),
        ("min and max swapped", lambda q, lo, hi: q.clamp(min=0) @ lo.T + q.clamp(max=0) @ hi.T),
    ],
    "check_group_mean_query": [
        ("groups taken strided, not contiguous",
         lambda q, hkv: q.reshape(q.shape[0], q.shape[1] // hkv, hkv, q.shape[2]).mean(1)),
        ("the group's first head only", lambda q, hkv: q[:, :: q.shape[1] // hkv]),
    ],
    "check_act_quant_blocks": [
        ("one scale per row, not per block", lambda x, b: quantize_fp8(x, x.shape[1])),
        ("no 1e-4 floor on the block maximum",
         lambda x, b: _quant_no_floor(x, b)),
    ],
    "check_rope_interleaved": [
        ("half-split pairs, not interleaved", lambda x, p, r, th: apply_rope(x, p, r, th, interleaved=False)),
        ("every dim rotated", lambda x, p, r, th: apply_rope(x, p, x.shape[1], th, interleaved=True)),
    ],
    "check_ordered_bits": [
        ("-0.0 not folded into +0.0", keys_of),
        ("both zeros get the key of -0.0", lambda x: torch.where(x == 0, 0x7FFFFFFF, keys_of(x + 0.0))),
    ],
    "check_kth_digit": [
        ("the k-th smallest key", lambda keys, k: ((d := int(keys.sort().values[k - 1]) >> 24),
                                                   int(((keys >> 24) > d).sum()))),
        ("keys at or above the digit counted", lambda keys, k: ((d := int(keys.sort(descending=True).values[k - 1])
                                                                 >> 24), int(((keys >> 24) >= d).sum()))),
    ],
    "check_sign_split_scores": [
        ("the sign ignored", lambda q, lo, hi: torch.einsum("bhd,phd->bp", q, hi)),
        ("min and max swapped", lambda q, lo, hi: torch.einsum("bhd,phd->bp", q.clamp(min=0), lo)
         + torch.einsum("bhd,phd->bp", q.clamp(max=0), hi)),
    ],
    "check_row_max": [
        ("the first block only", lambda x: x[:, :128].amax(1)),
        ("the tail padded with 0, not -inf",
         lambda x: torch.nn.functional.pad(x, (0, (-x.shape[1]) % 128 or 128)).amax(1)),
    ],
    "check_score_from_pages": [
        ("132 bytes per token (the API's shape), key then scale",
         lambda buf, row, s, q, w, page, d: (lambda t: t[d:].view(torch.float32)[0] * (w * (
             q @ t[:d].view(torch.float8_e4m3fn).float()).clamp(min=0)).sum())(
             buf[int(row[s // page])][(s % page) * (d + 4):(s % page + 1) * (d + 4)].clone())),
        ("the pages taken in order, not through the block table",
         lambda buf, row, s, q, w, page, d: (lambda p: p[page * d:].view(torch.float32)[s % page] * (w * (
             q @ p[(s % page) * d:(s % page + 1) * d].view(torch.float8_e4m3fn).float()).clamp(min=0)).sum())(
             buf[s // page].clone())),
        ("the scale left out",
         lambda buf, row, s, q, w, page, d: (lambda p: (w * (
             q @ p[(s % page) * d:(s % page + 1) * d].view(torch.float8_e4m3fn).float()).clamp(min=0)).sum())(
             buf[int(row[s // page])].clone())),
    ],
    "check_mass_kept": [
        ("the mass of the first pages, not the kept ones",
         lambda probs, kept, P: torch.stack([probs[i, : len(k) * P].sum() for i, k in enumerate(kept)])),
        ("the mass left out", lambda probs, kept, P: 1 - torch.stack(
            [sum(probs[i, p * P:(p + 1) * P].sum() for p in k) for i, k in enumerate(kept)])),
    ],
    "check_graph_bucket": [
        ("first fit in the order given", lambda bs, buckets: next((b for b in buckets if b >= bs), None)),
        ("the largest bucket when none holds the batch", lambda bs, buckets: min(
            [b for b in buckets if b >= bs], default=max(buckets, default=None))),
    ],
    "check_rank_heads": [
        ("KV heads not split", lambda r, w, hq, hkv: (slice(r * hq // w, (r + 1) * hq // w), slice(0, hkv))),
        ("query heads strided", lambda r, w, hq, hkv: (slice(r, hq, w), slice(r * hkv // w, (r + 1) * hkv // w))),
    ],
    "check_global_selection": [
        ("each rank on its own scores", lambda shares, lens, P, cfg: select_pages(
            shares[0], lens, torch.ones(len(lens), dtype=torch.bool), P, cfg)),
        ("the ranks' maximum, not their sum", lambda shares, lens, P, cfg: select_pages(
            torch.stack(shares).amax(0), lens, torch.ones(len(lens), dtype=torch.bool), P, cfg)),
    ],
    "check_order_hash": [
        ("a plain sum", lambda ids: int(ids.long().sum())),
        ("a weighted sum (linear)", lambda ids: int(((ids.reshape(-1).long() + 3) * (
            torch.arange(ids.numel()) * 2 + 1) * 0x9E3779B1).sum())),
    ],
    "check_merge_splits": [
        ("a plain mean of the slices", lambda outs, lses: outs.mean(0)),
        ("NaN when every slice is empty (no guard on the weights' sum)", lambda outs, lses: (
            torch.exp(lses - lses.max())[:, None] * outs).sum(0) / torch.exp(lses - lses.max()).sum()),
        ("exp(lse) without the max shift",
         lambda outs, lses: (torch.exp(lses)[:, None] * outs).sum(0) / torch.exp(lses).sum()),
    ],
    "check_page_table_row": [
        ("the last kept page counted as full", lambda kept, seq_len, row, P: _table_row(kept, seq_len, row, P,
                                                                                        full_last=True)),
        ("a dense row's pages from the row's length", lambda kept, seq_len, row, P: _table_row(
            kept, seq_len, row, P, dense_from_row=True)),
        ("each page read at its last slot", lambda kept, seq_len, row, P: _table_row(kept, seq_len, row, P,
                                                                                    last_slot=True)),
    ],
    "check_lru_victims": [
        ("the lowest free slots, no LRU", lambda tokens, used, hits, m: [
            s for s in range(len(tokens)) if s not in hits][:m]),
        ("the most recently used evicted", lambda tokens, used, hits, m: sorted(sorted(
            (s for s in range(len(tokens)) if s not in hits),
            key=lambda s: (tokens[s] >= 0, -used[s], s))[:m])),
        ("victims in LRU order, not slot order", lambda tokens, used, hits, m: sorted(
            (s for s in range(len(tokens)) if s not in hits),
            key=lambda s: (tokens[s] >= 0, used[s] if tokens[s] >= 0 else 0, s))[:m]),
        ("a plain LRU that may evict a slot read this step", lambda tokens, used, hits, m: sorted(sorted(
            range(len(tokens)), key=lambda s: (tokens[s] >= 0, used[s] if tokens[s] >= 0 else 0, s))[:m])),
    ],
    "check_break_even_batch": [
        ("against the device at batch 1, not its best", lambda td, to, nd, no: next(
            (b for b in range(1, no + 1) if b / to(b) > 1 / td(1)), None)),
        ("past what offload fits", lambda td, to, nd, no: next(
            (b for b in range(1, 10 * no) if b / to(b) > max(c / td(c) for c in range(1, nd + 1))), None)),
        ("one short of the offload limit", lambda td, to, nd, no: next(
            (b for b in range(1, no) if b / to(b) > max(c / td(c) for c in range(1, nd + 1))), None)),
        (">= instead of beats", lambda td, to, nd, no: next(
            (b for b in range(1, no + 1) if b / to(b) >= max(c / td(c) for c in range(1, nd + 1))), None)),
        ("the device's best taken at its maximum", lambda td, to, nd, no: next(
            (b for b in range(1, no + 1) if b / to(b) > nd / td(nd)), None)),
        ("a search starting past the device's limit", lambda td, to, nd, no: next(
            (b for b in range(nd + 1, no + 1) if b / to(b) > max(c / td(c) for c in range(1, nd + 1))), None)),
    ],
}


def _quant_no_floor(x, block):
    t, n = x.shape
    blocks = x.reshape(t, n // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 448.0
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(t, n), scale.squeeze(-1)


def _table_row(kept, seq_len, row, P, full_last=False, dense_from_row=False, last_slot=False):
    n = len(row) // P if dense_from_row else cdiv(seq_len, P)
    logical = list(kept) if kept else list(range(n))
    pages = [row[j * P + (P - 1 if last_slot else 0)] // P for j in logical]
    if not kept:
        return pages, seq_len
    last = P if full_last else seq_len - (cdiv(seq_len, P) - 1) * P
    return pages, (len(kept) - 1) * P + last


def cases():
    for name, wrongs in WRONG.items():
        for label, fn in wrongs:
            yield pytest.param(name, fn, id=f"{name.removeprefix('check_')}: {label}")


@pytest.mark.parametrize("checker, wrong", list(cases()))
def test_checker_rejects_a_plausible_mistake(checker, wrong):
    with pytest.raises(AssertionError) as info:
        getattr(checkers, checker)(wrong)
    message = str(info.value)
    assert message.strip(), "the message must say what was wrong"
    assert not message.startswith("Tensor-likes"), f"the message must name the case: {message[:200]}"


def test_every_exercise_checker_has_two_mistakes():
    """Each checker of the notebooks' exercises is tried with at least two wrong solutions (Triton ones, the
    puzzles among them: in test_exercises.py, which also holds two a puzzle)."""
    names = {n for n in dir(checkers) if n.startswith("check_")}
    triton = {"check_row_argmax", "check_page_table_kernel", *(f"check_{name}" for name in PUZZLES)}
    assert names - triton == set(WRONG), sorted(names - triton ^ set(WRONG))
    assert all(len(w) >= 2 for w in WRONG.values())


def test_the_mistakes_are_really_wrong_and_the_reference_passes():
    """Sanity of the table above: the reference solutions pass (so a rejection is the mistake's doing)."""
    checkers.check_topk_in_prefix(lambda s, lens, k: topk_reference(s, k, lens, order="index"))
    checkers.check_ordered_bits(lambda x: keys_of(x + 0.0))
    assert math.isfinite(float(torch.exp(torch.tensor(80.0))))


# 05's Triton puzzles: a kernel with a mask missing (tests/test_exercises.py holds the kernels, at module level for
# the compile check) and a plausible mistake in torch
@pytest.mark.parametrize("name", PUZZLES)
@pytest.mark.parametrize("which", ["a mask missing", "a plausible mistake"])
def test_each_puzzle_checker_rejects_a_missing_mask_and_a_plausible_mistake(name, which):
    wrong = PUZZLES[name][which == "a plausible mistake"]
    with pytest.raises(AssertionError) as info:
        getattr(checkers, f"check_{name}")(wrong)
    if which == "a mask missing":
        assert "mask" in str(info.value), str(info.value)[:300]  # the sentence says what went wrong
