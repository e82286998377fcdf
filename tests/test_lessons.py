"""The lesson kernels of the top-level ``kernels/`` folder, each equal to its fast-tier twin and to the torch reference.

Notebooks 05, 06 and 09 show and run these files; here each one meets its twin in ``sparse_ref.kernels`` on
fresh awkward inputs (lengths that are not powers of two, 0 and 1, ties, plateaus, NaN and -inf), in
seconds, without running a whole notebook. ``kernels/`` has no ``__init__.py`` (it must not shadow the PyPI
package ``kernels``), so its folder goes on ``sys.path`` here, as the notebooks put it there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import sparse_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

import delegate_kernels  # noqa: E402
import dsa_logits  # noqa: E402
import flash_decode  # noqa: E402
import quest_scores  # noqa: E402
import radix_topk  # noqa: E402
import select_to_table  # noqa: E402
import swap_in as swap_in_lesson  # noqa: E402

from sparse_ref.algorithms.dsa import indexer_logits, paged_indexer_logits_reference  # noqa: E402
from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign  # noqa: E402
from sparse_ref.attention import sparse_decode_attention  # noqa: E402
from sparse_ref.config import SparseConfig  # noqa: E402
from sparse_ref.fp8 import quantize_fp8  # noqa: E402
from sparse_ref.kernels.decode_attention import paged_decode_attention  # noqa: E402
from sparse_ref.kernels.dsa import paged_indexer_logits  # noqa: E402
from sparse_ref.kernels.page_select import select_pages_to_table  # noqa: E402
from sparse_ref.kernels.quest import quest_page_scores_from_queries  # noqa: E402
from sparse_ref.kernels.topk import topk  # noqa: E402
from sparse_ref.offload import HostKVPool, HotBuffer  # noqa: E402
from sparse_ref.selection import select_pages, topk_reference  # noqa: E402

DEVICE = sparse_ref.default_device()


def test_lessons_folder_is_not_a_package():
    root = Path(__file__).resolve().parents[1] / "kernels"
    assert not (root / "__init__.py").exists()
    assert {p.stem for p in root.glob("*.py")} >= {"radix_topk", "delegate_kernels", "quest_scores", "dsa_logits",
                                                    "select_to_table", "flash_decode", "swap_in"}


# ---------------------------------------------------------------- notebook 05: radix top-k, delegates
def awkward_rows(rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    x[1 % rows] = torch.randint(0, 3, (n,), generator=g).float()  # three values: ties everywhere
    x[2 % rows, ::3] = float("nan")
    x[2 % rows, 1::3] = float("-inf")
    x[3 % rows, : n // 2] = -0.0
    x[3 % rows, n // 2:] = 0.0  # -0.0 ties +0.0
    lengths = torch.randint(0, n + 1, (rows,), generator=g)
    lengths[:3] = torch.tensor([n, 0, 1])[: min(rows, 3)]
    lengths[-1] = min(max(k - 1, 0), n)  # fewer candidates than k: -1 padding
    return x.to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize("rows,n,k,seed", [(5, 200, 12, 0), (4, 97, 97, 1), (3, 33, 50, 2), (6, 130, 1, 3)])
def test_radix_topk_equals_package_topk_and_reference(rows, n, k, seed):
    x, lengths = awkward_rows(rows, n, k, seed)
    ours = radix_topk.radix_topk(x, k, lengths)
    package = topk(x, k, lengths, order="index")
    assert torch.equal(ours.cpu(), package.cpu())
    assert torch.equal(ours.cpu(), topk_reference(x.cpu(), k, lengths.cpu(), order="index"))


def test_radix_topk_writes_only_its_own_rows():
    """Each program writes exactly k slots of its own row: a guard past the last row stays untouched, on plateau
    rows (where one extra tie kept would spill into the next row, which the interpreter's serial order hides)."""
    rows, n, k = 3, 40, 7
    x = torch.randint(0, 2, (rows, n)).float().to(DEVICE)  # two values: the k-th key is tied many times
    lengths = torch.full((rows,), n, device=DEVICE)
    out = torch.full((rows * k + 16,), 12345, dtype=torch.int32, device=DEVICE)
    radix_topk.radix_topk_kernel[(rows,)](x, out, lengths, n, k, N_PAD=64, K_PAD=8)
    assert bool((out[rows * k:] == 12345).all())
    assert torch.equal(out[: rows * k].view(rows, k).cpu(), topk_reference(x.cpu(), k, lengths.cpu(), order="index"))


def test_sortable_keys_order_like_floats():
    values = torch.tensor([float("nan"), float("-inf"), -3.0e38, -1.5, -0.0, 0.0, 1e-30, 1.5, float("inf")])
    keys = radix_topk.sortable_keys(values.to(DEVICE)).cpu().to(torch.int64) & 0xFFFFFFFF
    assert keys[0] == 0 and keys[1] == 0  # NaN and -inf are never candidates
    assert keys[4] == keys[5]  # -0.0 == +0.0
    assert bool((keys[3:] >= keys[2:-1]).all()) and keys[2] > 0
    x = torch.randn(77)
    order = radix_topk.sortable_keys(x.to(DEVICE)).cpu().to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(order.argsort(), x.argsort())


@pytest.mark.parametrize("n,g", [(256, 32), (512, 64)])
def test_delegates_and_bitmask(n, g):
    x = torch.randn(3, n)
    x[1] = torch.randint(0, 4, (n,)).float()  # plateaus
    dlg = delegate_kernels.delegates(x.to(DEVICE), g).cpu()
    assert torch.equal(dlg, x.view(3, n // g, g).amax(1))
    T = dlg.topk(5, dim=1).values[:, -1]  # the 5th largest delegate: at least 5 keys reach it
    words = delegate_kernels.candidate_bits(x.to(DEVICE), T.to(DEVICE)).cpu().to(torch.int64) & 0xFFFFFFFF
    bits = ((words[..., None] >> torch.arange(32)) & 1).reshape(3, n).bool()
    assert torch.equal(bits, x >= T[:, None])
    assert bool((bits.sum(1) >= 5).all())


# ---------------------------------------------------------------- notebook 06: Quest scores, DSA logits
@pytest.mark.parametrize("bs,max_pages,hkv,group,d,P,seed", [(3, 11, 2, 2, 24, 4, 0), (1, 1, 1, 1, 8, 1, 1),
                                                           (4, 37, 3, 4, 16, 16, 2)])
def test_quest_scores_equal_package_and_reference(bs, max_pages, hkv, group, d, P, seed):
    """The lesson scores split queries over a page list; the package's kernel (what QuestAlgorithm runs) does the
    split and the page mapping itself: equal through ``split_query_sign`` and the physical pages, to fp32 rounding."""
    g = torch.Generator().manual_seed(seed)
    num_pages = bs * max_pages + 3
    a, b = torch.randn(num_pages, hkv, d, generator=g), torch.randn(num_pages, hkv, d, generator=g)
    page_min, page_max = torch.minimum(a, b), torch.maximum(a, b)
    page_valid = torch.rand(num_pages, generator=g) > 0.2
    page_valid[0] = False  # padding page
    rows = torch.randperm(bs + 1, generator=g)[:bs]
    r2t = torch.randint(0, num_pages * P, (bs + 1, max_pages * P), generator=g, dtype=torch.int32)
    pages = (r2t[rows[:, None], torch.arange(max_pages) * P] // P).to(torch.int32)  # physical_pages
    q = torch.randn(bs, hkv * group, d, generator=g)
    q_pos, q_neg = split_query_sign(q, hkv, d, "mean")
    on = [t.to(DEVICE).contiguous() for t in (q_pos, q_neg, page_min, page_max, page_valid, pages)]
    ours = quest_scores.teaching_quest_scores(*on).cpu()
    package = quest_page_scores_from_queries(*[t.to(DEVICE) for t in (q, page_min, page_max, page_valid, r2t, rows)],
                                             P, max_pages).cpu()
    for want in (package, quest_page_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages)):
        assert torch.equal(torch.isneginf(ours), torch.isneginf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(ours[finite], want[finite], rtol=1e-5, atol=1e-4)
    assert bool(torch.isneginf(ours[~page_valid[pages.long()]]).all())  # a page without bounds never scores


def dsa_case(lens, page=64, heads=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs, max_pages = len(lens), max(-(-n // page) for n in lens)
    num_pages = bs * max_pages + 1
    block_table = (torch.randperm(num_pages - 1, generator=g)[: bs * max_pages] + 1).reshape(bs, max_pages).int()
    k8, k_scale = quantize_fp8(torch.randn(num_pages * page, d, generator=g), d)
    k_scale = k_scale.squeeze(-1)
    kv_buf = torch.cat([k8.view(torch.uint8).view(num_pages, page * d),
                        k_scale.view(num_pages, page).contiguous().view(torch.uint8)], dim=1)
    token_req = list(range(bs)) + [bs - 1] * 2  # a decode token per request, two prefill tokens of the last one
    bound = list(lens) + [lens[-1] - 1, lens[-1]]
    q8, q_scale = quantize_fp8(torch.randn(len(token_req), heads, d, generator=g), d)
    w = torch.randn(len(token_req), heads, generator=g) * heads**-0.5 * q_scale.squeeze(-1)
    on = {"device": DEVICE}
    return {"q8": q8.to(**on), "w": w.to(**on), "kv_buf": kv_buf.to(**on), "block_table": block_table.to(**on),
            "token_req": torch.tensor(token_req, dtype=torch.int32, **on),
            "bound": torch.tensor(bound, dtype=torch.int32, **on), "k8": k8, "k_scale": k_scale, "page": page}


@pytest.mark.parametrize("lens", [[1, 63, 64, 65], [130]])
def test_dsa_logits_equal_package_and_indexer_formula(lens):
    c = dsa_case(lens)
    page, d = c["page"], c["q8"].shape[2]
    args = [c[n] for n in ("q8", "w", "kv_buf", "block_table", "token_req", "bound")]
    ours = dsa_logits.teaching_dsa_logits(*args, page_size=page).cpu()
    n = c["kv_buf"].shape[0]
    keys = c["kv_buf"][:, : page * d].view(torch.float8_e4m3fn).view(n, page, d)
    scales = c["kv_buf"].view(torch.float32)[:, page * d // 4:]
    width = c["block_table"].shape[1] * page
    package = paged_indexer_logits(c["q8"], c["w"], keys, scales, *args[3:], width).cpu()
    reference = paged_indexer_logits_reference(c["q8"], c["w"], keys, scales, *args[3:], width).cpu()
    rel = 5e-3 if DEVICE.type == "cuda" else 1e-5  # GPU: FP8 tensor-core accumulation
    for want in (package, reference):
        assert torch.equal(torch.isneginf(ours), torch.isneginf(want))
        finite = torch.isfinite(want)
        scale = want.masked_fill(~finite, 0).abs().amax(1, keepdim=True).clamp_min(1e-30)
        assert float(((ours - want).abs() / scale)[finite].max()) <= rel
    t = 0  # one token by the formula itself: its request's keys gathered through the page table
    slots = (c["block_table"][0].long().cpu()[:, None] * page + torch.arange(page)).reshape(-1)[: lens[0]]
    direct = indexer_logits(c["q8"][:1].cpu(), c["w"][:1].cpu(), c["k8"][slots], c["k_scale"][slots])[0]
    torch.testing.assert_close(ours[t, : lens[0]], direct, rtol=rel, atol=rel * float(direct.abs().max()))


# ---------------------------------------------------------------- notebook 09: select + table, flash decode
def decode_batch(bs, max_pages, page, seed):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, max_pages * page + 1, (bs,), generator=g)
    seq_lens[:4] = torch.tensor([0, 1, page + 1, max_pages * page])[: min(bs, 4)]
    physical = 1 + torch.randperm(bs * max_pages + 5, generator=g)[: bs * max_pages].view(bs, max_pages)
    req_to_token = (physical[:, :, None] * page + torch.arange(page)).reshape(bs, max_pages * page)
    scores = torch.randn(bs, max_pages, generator=g).round(decimals=1)  # many ties
    scores[2 % bs, ::5] = float("nan")
    scores[3 % bs, 1::4] = float("-inf")
    scores[bs - 1] = 0.5  # a plateau
    sparse_mask = torch.rand(bs, generator=g) > 0.2
    b = {"scores": scores, "seq_lens": seq_lens.int(), "sparse_mask": sparse_mask,
         "rows": torch.randperm(bs, generator=g).int(), "req_to_token": req_to_token.int()}
    return {name: t.to(DEVICE) for name, t in b.items()}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", [SparseConfig(page_budget=3, num_recent_pages=2, num_sink_pages=1),
                                    SparseConfig(keep_ratio=0.3, num_recent_pages=1)])
def test_select_to_table_equals_package_and_selection(seed, config):
    page = 4
    b = decode_batch(6 + seed, 13 - seed, page, seed)
    ours = select_to_table.teaching_page_table(b, page, config)
    package = select_pages_to_table(b["scores"], b["seq_lens"], b["sparse_mask"], page, config, b["rows"],
                                    b["req_to_token"])
    for a, c in zip(ours, package, strict=True):
        assert torch.equal(a.cpu(), c.cpu())
    ref_sel, ref_len = select_pages(b["scores"], b["seq_lens"], b["sparse_mask"], page, config)
    assert torch.equal(ours[0].cpu(), ref_sel.cpu()) and torch.equal(ours[1].cpu(), ref_len.cpu())


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_flash_decode_equals_package_and_reference(splits):
    page, hkv, hq, d = 4, 2, 6, 24
    b = decode_batch(5, 9, page, 3)
    _, _, table, kv_lens, _ = select_to_table.teaching_page_table(b, page, SparseConfig(page_budget=2))
    slots = int(b["req_to_token"].max()) + 1 + page
    g = torch.Generator().manual_seed(splits)
    k = torch.randn(slots, hkv, d, generator=g).to(DEVICE)
    v = torch.randn(slots, hkv, d, generator=g).to(DEVICE)
    q = torch.randn(5, hq, d, generator=g).to(DEVICE)
    ours = flash_decode.teaching_decode_attention(q, k, v, table, kv_lens, page, splits).cpu()
    package = paged_decode_attention(q, k, v, table, kv_lens, page).cpu()
    reference = sparse_decode_attention(q, k, v, table, kv_lens, page).cpu()
    torch.testing.assert_close(ours, package, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(ours, reference, rtol=2e-3, atol=2e-3)
    assert bool((ours[0] == 0).all())  # request 0 has no tokens: zeros


# ---------------------------------------------------------------- notebook 10: the offload swap-in
@pytest.mark.parametrize("size, seed", [(5, 0), (13, 1)])
def test_teaching_swap_in_equals_the_reference(size, seed):
    """Step after step (sliding windows, jumps, short dense rows, a row forgotten and reused, batch order not row
    order): the same tables, slots, LRU state and hot K/V as ``HotBuffer.swap_in``."""
    rows, max_ctx, width, g = 3, 40, 18, torch.Generator().manual_seed(seed)
    host = HostKVPool(1 + rows * max_ctx, 1, 2, 3)
    host.k[0].copy_(torch.randn(host.k[0].shape, generator=g))
    host.v[0].copy_(torch.randn(host.v[0].shape, generator=g))
    r2t = (1 + torch.randperm(rows * max_ctx, generator=g)).int().view(rows, max_ctx)
    ref, lesson = HotBuffer(1, rows, size, 2, 3, max_ctx), HotBuffer(1, rows, size, 2, 3, max_ctx, device=DEVICE)
    seq = [9, 20, 4]
    for it in range(10):
        seq = [x + 1 for x in seq]
        order = [2, 0, 1] if it % 2 else [0, 1, 2]
        positions = torch.zeros(rows, width, dtype=torch.int32)
        counts = torch.zeros(rows, dtype=torch.int32)
        for b, r in enumerate(order):
            keep = min(size, seq[r] - 1)
            pick = torch.randperm(seq[r] - 1, generator=g)[:keep] if it % 3 == 2 else torch.arange(seq[r] - 1 - keep,
                                                                                                     seq[r] - 1)
            want = sorted(pick.tolist()) + [seq[r] - 1]
            positions[b, : len(want)], counts[b] = torch.tensor(want), len(want)
        args = (torch.tensor(order), positions, counts, torch.tensor(seq)[order])
        want = ref.swap_in(0, *args, host, r2t)
        got = swap_in_lesson.teaching_swap_in(lesson, 0, *(a.to(DEVICE) for a in args), host, r2t.to(DEVICE))
        assert torch.equal(got.cpu(), want)
        for name in ("token", "last_used", "slot_of", "clock"):
            assert torch.equal(getattr(lesson, name).cpu(), getattr(ref, name)), (it, name)
        held = ref.token[0] >= 0
        for side in ("k", "v"):  # (V copied from the host's K pool once passed a K-only check)
            hot_ref, hot_les = (getattr(h, side)[0][1:].view(rows, size + 1, 2, 3)[:, :-1][held] for h in (ref, lesson))
            assert torch.equal(hot_les.cpu(), hot_ref), (it, side)
        if it == 5:
            ref.forget(1)
            lesson.forget(1)
            seq[1] = 2
    assert ref.misses > 0 and ref.hits > 0
