"""Figures the notebooks draw, one function per figure, so that the lessons' cells hold the lesson.

Each function returns a matplotlib figure with a title; the notebook shows it with
``sparse_ref.figures.show_figure(fig, alt)`` (``show_*`` functions do both, with their own alt text).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from sparse_ref.figures import show_figure

RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


# ---------------------------------------------------------------- 00_overview
def _box(ax, xy, w, h, title, body, color):
    """A rounded box with a bold title and a smaller body text; returns its centre-left/right anchors."""
    x, y = xy
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="0.25", linewidth=1.2))
    ax.text(x + w / 2, y + h - 0.17, title, ha="center", va="top", fontsize=10.5, fontweight="bold")
    ax.text(x + w / 2, y + h / 2 - 0.16, body, ha="center", va="center", fontsize=8.2, linespacing=1.35)
    return (x, y + h / 2), (x + w, y + h / 2)


def _arrow(ax, start, end, label=""):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.3, color="0.2",
                                 connectionstyle="arc3,rad=0.0"))
    if not label:
        return
    mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
    if start[1] == end[1]:  # horizontal: write the label above the arrow
        ax.text(mx, my + 0.08, label, ha="center", va="bottom", fontsize=7.5, color="0.25", style="italic")
    else:
        ax.text(mx, my, label, ha="center", va="center", fontsize=7.5, color="0.25", style="italic",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})


STAGES = ("req_to_token", "quest", "dsa", "topk", "adaptor", "attention")
# The stages each notebook builds (00's picture, marked at the top of every notebook)
NOTEBOOK_STAGES = {"00": STAGES, "01": ("req_to_token",), "02": ("topk", "adaptor"), "03": ("quest",),
                   "04": ("dsa",), "05": ("topk",), "06": ("quest", "dsa"), "07": STAGES,
                   "08": ("quest", "dsa", "attention"), "09": ("topk", "adaptor", "attention"),
                   "10": ("req_to_token", "attention")}


def you_are_here(notebook: str) -> None:
    """00's picture of the decode step with the stages ``notebook`` ("03") builds marked, the others faded."""
    marked = NOTEBOOK_STAGES[notebook]
    fig = decode_step_pipeline(marked)
    fig.axes[0].set_title(f"Notebook {notebook}: the marked stages of one decode step", fontsize=12)
    names = ", ".join(marked) if len(marked) < len(STAGES) else "every stage"
    show_figure(fig, f"Diagram of one sparse decode step (req_to_token, Quest and DSA scores, top-k, adaptor, "
                f"attention) with the stages this notebook builds drawn in colour and the rest faded: {names}.")


def decode_step_pipeline(marked=STAGES):
    """One decode step, one layer: req_to_token -> Quest / DSA scores -> top-k -> adaptor -> attention; the stages
    not in ``marked`` are faded (the top of each notebook marks its own)."""
    fig, ax = plt.subplots(figsize=(15, 4.6))
    ax.set_xlim(0, 15.2)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    w, h = 2.3, 1.45
    r2t = _box(ax, (0.1, 1.55), w, h, "req_to_token",
               "row per request:\nlogical token t\n-> physical KV slot\n(paged, page 0 = padding)", "#dbe9f6")
    quest = _box(ax, (3.3, 2.75), w, h, "Quest: score pages",
                 "per page: min m, max M key\nbound Σ_d max(q·M, q·m)\n-> one score per page", "#fde2c8")
    dsa = _box(ax, (3.3, 0.35), w, h, "DSA: score tokens",
               "lightning indexer (FP8)\nΣ_h w_h · relu(q_h · k)\n-> one score per token", "#fde2c8")
    topk = _box(ax, (6.5, 1.55), w, h, "top-k", "best k of the history\n+ recent (+ sink) pages\nties -> lower id; "
                "NaN never\n-> logical ids, -1 padded", "#e2f0d9")
    adapt = _box(ax, (9.7, 1.55), w, h, "adaptor",
                 "logical -> physical pages\nvia req_to_token\nKV length per request,\ncumulative lengths", "#e7dff2")
    attn = _box(ax, (12.8, 1.55), w, h, "attention", "over the selected KV only\n(dense rows: all of it)", "#f6d5d5")
    for patch, stage in zip(ax.patches, STAGES, strict=True):  # the boxes, in the order drawn
        if stage not in marked:
            patch.set_facecolor("0.93")
            patch.set_edgecolor("0.75")
        elif len(marked) < len(STAGES):
            patch.set_linewidth(2.6)
            patch.set_edgecolor("tab:red")
    _arrow(ax, r2t[1], quest[0], "pages of the row")
    _arrow(ax, r2t[1], dsa[0], "tokens of the row")
    _arrow(ax, quest[1], topk[0], "[bs, pages]")
    _arrow(ax, dsa[1], topk[0], "[tokens, ctx]")
    _arrow(ax, topk[1], adapt[0], "selected, lengths")
    _arrow(ax, adapt[1], attn[0], "page table")
    ax.set_title("One decode step, one layer: five stages", fontsize=12)
    return fig


# ---------------------------------------------------------------- 01_req_to_token_pool
def show_pools(manager, reqs: dict, title: str) -> None:
    """req_to_token coloured by physical page (left) beside the physical pages, in the same colours, labelled
    with their owner (right): one colour means one physical page in both panels."""
    table = manager.req_to_token_pool.req_to_token.cpu()
    P, num_pages = manager.page_size, manager.allocator.num_pages
    rows, cols = table.shape
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(15, 3.6), gridspec_kw={"width_ratios": [3, 1.3]})
    lens, name_of_row, owner = torch.zeros(rows, dtype=torch.long), {}, ["free"] * num_pages
    owner[0] = "pad"
    for name, req in reqs.items():
        lens[req.req_pool_idx], name_of_row[req.req_pool_idx] = req.seq_len, name
        for p in req.pages:
            owner[p] = name
    live = torch.arange(cols)[None, :] < lens[:, None]
    cmap = plt.get_cmap("tab20", num_pages).copy()
    cmap.set_bad("#f7f7f7")
    im = ax_t.imshow(np.ma.masked_array((table // P).numpy(), mask=~live.numpy()), cmap=cmap, vmin=-0.5,
                     vmax=num_pages - 0.5, aspect="auto")
    for r in range(rows):
        for t in range(int(lens[r])):
            ax_t.text(t, r, int(table[r, t]), ha="center", va="center", fontsize=7)
    ax_t.set_yticks(range(rows), [f"row {r} ({name_of_row.get(r, 'free')})" for r in range(rows)])
    ax_t.set_xlabel("logical token position t   (cell text: physical slot)")
    ax_t.set_xticks(range(0, cols, P))
    for x in range(P, cols, P):
        ax_t.axvline(x - 0.5, color="white", linewidth=2)
    fig.colorbar(im, ax=ax_t, label="physical page", ticks=range(num_pages))
    ax_t.set_title(f"req_to_token ({title})")
    owned = np.ma.masked_array(np.arange(num_pages)[None, :], mask=[[o in ("free", "pad") for o in owner]])
    ax_p.imshow(owned, cmap=cmap, vmin=-0.5, vmax=num_pages - 0.5)
    for p, o in enumerate(owner):
        ax_p.text(p, 0, f"{p}\n{o}", ha="center", va="center", fontsize=7)
    ax_p.set_yticks([])
    ax_p.set_xticks([])
    ax_p.set_xlabel("physical page (same colours; text: id and owner)")
    ax_p.set_title("page ownership")
    plt.tight_layout()
    show_figure(fig, f"Left: the req_to_token table ({title}), one row per request row and one column per logical "
                "token; each live cell shows its physical slot and is coloured by its physical page. Right: one "
                "square per physical page in the same colours, labelled with its owner; free pages and the "
                "reserved padding page 0 are blank.")


# ---------------------------------------------------------------- 08_tensor_parallel
def heads_over_ranks(num_q_heads: int, num_kv_heads: int, world: int):
    """Query heads (top row) and the KV heads they read (bottom row), coloured by the rank that holds them."""
    group = num_q_heads // num_kv_heads
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for h in range(num_q_heads):
        rank = h // (num_q_heads // world)
        ax.add_patch(plt.Rectangle((h, 1.2), 0.9, 0.6, color=RANK_COLOURS[rank % 4]))
        ax.annotate("", xy=((h // group) * group + group / 2 - 0.05, 0.8), xytext=(h + 0.45, 1.2),
                    arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.8})
    for kv in range(num_kv_heads):
        rank = kv // (num_kv_heads // world)
        ax.add_patch(plt.Rectangle((kv * group, 0.2), group - 0.1, 0.6, color=RANK_COLOURS[rank % 4], alpha=0.6))
        ax.text(kv * group + group / 2 - 0.05, 0.5, f"KV head {kv}", ha="center", va="center", fontsize=9)
    for r in range(world):
        ax.plot([], [], "s", color=RANK_COLOURS[r % 4], label=f"rank {r}")
    ax.text(-0.3, 1.5, "query heads", ha="right", va="center", fontsize=9)
    ax.text(-0.3, 0.5, "KV heads", ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.5, num_q_heads + 0.2)
    ax.set_ylim(0, 2.0)
    ax.axis("off")
    ax.legend(loc="upper center", ncol=world, fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.02))
    ax.set_title(f"{num_q_heads} query heads and {num_kv_heads} KV heads over {world} ranks: each rank holds whole "
                 "GQA groups", fontsize=10)
    return fig


def scores_over_ranks(partials, total, kept_global, kept_per_rank):
    """Each rank's page scores (its heads' share) and their sum; the pages each selection keeps.

    Scores are drawn above the row's lowest finite score (they are large and close together); pages without
    a score (-inf: the incomplete last page, always kept as recent) are left out."""
    pages = np.arange(len(total))
    fig, axes = plt.subplots(1, len(partials) + 1, figsize=(12, 3.4))
    panels = [(part, set(kept_per_rank[r]), RANK_COLOURS[r % 4], f"rank {r}: its heads' share\n(coloured: kept "
               "by its per-rank selection)") for r, part in enumerate(partials)]
    panels.append((total, set(kept_global), "black", "sum over ranks (one all-reduce)\n(black: kept by the global "
                   "selection)"))
    for ax, (scores, kept, colour, title) in zip(axes, panels, strict=True):
        scores = np.asarray(scores, dtype=np.float64)
        finite = np.isfinite(scores)
        height = np.where(finite, scores - scores[finite].min(), 0.0)
        ax.bar(pages[finite], height[finite], width=1.0,
               color=[colour if p in kept else "lightgrey" for p in pages[finite]])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("logical page")
    axes[0].set_ylabel("score above the row's lowest")
    fig.suptitle("Quest under tensor parallelism: per-rank selections against the global one", fontsize=11)
    fig.tight_layout()
    return fig


def tensor_parallel_results(rows):
    """Per set-up of the 2-rank run: the share of selections equal to one process and the ranks' agreement."""
    labels = [r["setup"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for offset, key, label in ((-0.2, "equal_to_one_process", "selection = one process"),
                               (0.2, "ranks_agree", "ranks agree")):
        values = [100 * r[key] for r in rows]
        bars = ax.bar(x + offset, values, 0.4, label=label)
        ax.bar_label(bars, [f"{v:.0f}%" for v in values], fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("% of sparse rows")
    ax.set_ylim(0, 130)
    ax.legend(loc="upper center", ncol=2, fontsize=9)
    ax.set_title("The 2-process run (torchrun): which set-ups reproduce one process, and which agree across ranks",
                 fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 03_quest
def quality_against_budget(budgets, results, oracle_k, pages_label):
    """Recall, mass kept and needle pages kept against the page budget, one line per scoring method."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    titles = (f"recall of the oracle's top {oracle_k} pages", "attention mass kept", "planted needle pages kept")
    for ax, key, title in zip(axes, ("recall", "mass", "needles"), titles, strict=True):
        for name, style in zip(results, ("o-", "s--", "x:"), strict=True):
            ax.plot(budgets, results[name][key], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel(f"page budget ({pages_label})")
        ax.set_title(title)
        ax.set_ylim(0, 1.05)
    axes[0].legend()
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 06_triton_scoring
def quest_program_grid(block_p: int, seed: int):
    """The Quest kernel's grid (page block, request), and the scattered pool rows one program reads."""
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, 2, figsize=(15, 5.2), gridspec_kw={"width_ratios": [1.1, 1]})
    ax, shown_blocks, shown_rows = axes[0], 8, 4
    for r in range(shown_rows):
        for blk in range(shown_blocks):
            picked = (r, blk) == (1, 2)
            ax.add_patch(Rectangle((blk, shown_rows - 1 - r), 0.92, 0.88, color="C3" if picked else "C0",
                                   alpha=0.85 if picked else 0.35))
            ax.text(blk + 0.46, shown_rows - 1 - r + 0.44, f"({blk},{r})", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, shown_blocks)
    ax.set_ylim(0, shown_rows)
    ax.set_xticks(np.arange(shown_blocks) + 0.46, [f"pages {block_p * k}..{block_p * k + block_p - 1}"
                                                    for k in range(shown_blocks)], rotation=45, fontsize=8)
    ax.set_yticks(np.arange(shown_rows) + 0.44, [f"request {r}" for r in reversed(range(shown_rows))])
    ax.set_title(f"Grid: program (pid0, pid1) = (page block, request)\nBLOCK_P = {block_p}", fontsize=10)
    ax, pool_rows = axes[1], 24
    ax.add_patch(Rectangle((0, 0), 8, pool_rows, fill=False, lw=1))
    phys = np.random.default_rng(seed).choice(np.arange(1, pool_rows), block_p, replace=False)
    for i, p in enumerate(phys):
        y = pool_rows - 1 - p
        ax.add_patch(Rectangle((0, y), 8, 1, color="C3", alpha=0.8))
        ax.annotate(f"logical page {2 * block_p + i} -> physical {p}", (8, y + 0.5), (9, 20 - 3 * i), fontsize=8,
                    arrowprops={"arrowstyle": "->", "lw": 0.8}, va="center")
    ax.add_patch(Rectangle((0, pool_rows + 1), 8, 0.8, color="C2", alpha=0.7))
    ax.text(4, pool_rows + 1.4, "q⁺, q⁻ of request 1 ([H_kv·D] each, loaded once)", ha="center", va="center",
            fontsize=8)
    for h in range(1, 4):
        ax.axvline(2 * h, ymax=pool_rows / (pool_rows + 2.5), color="grey", lw=0.5, ls=":")
    ax.text(4, -1.2, "H_kv·D bound values per row (KV head 0 | 1 | 2 | 3 ...)", ha="center", fontsize=8)
    ax.set_xlim(-0.5, 17)
    ax.set_ylim(-2, pool_rows + 2.5)
    ax.axis("off")
    ax.set_title("What program (2, 1) reads:\nBLOCK_P rows of the max pool (and of the min pool)", fontsize=10)
    fig.tight_layout()
    return fig


def dsa_program_diagram(d: int, h: int, page: int):
    """One DSA logits program on one page: K_page x Q^T -> S -> relu . w -> sum over heads -> x k_scale."""
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(14, 5.2))
    ax.set_xlim(0, 29)
    ax.set_ylim(-1.8, 9.6)
    ax.axis("off")

    def box(x, y, w, hgt, label, color, fontsize=9):
        ax.add_patch(Rectangle((x, y), w, hgt, color=color, alpha=0.35))
        ax.add_patch(Rectangle((x, y), w, hgt, fill=False, lw=1))
        ax.text(x + w / 2, y + hgt / 2, label, ha="center", va="center", fontsize=fontsize)

    def arrow(x0, x1, label=""):
        ax.add_patch(FancyArrowPatch((x0, 4), (x1, 4), arrowstyle="->", mutation_scale=14))
        ax.text((x0 + x1) / 2, 4.35, label, ha="center", fontsize=8)

    box(0, 1, 4, 6, f"K page\n[{page} tok, D={d}]\nFP8: the page's\nfirst {page * d} B", "C0")
    ax.text(4.4, 4, "×", fontsize=16, va="center")
    box(5.1, 4.5, 3.2, 3.2, f"Qᵀ\n[D, H={h}]\nFP8, the\nquery's heads", "C1")
    box(5.1, 1, 3.2, 0.9, "w [H] fp32", "C1")
    arrow(8.5, 10.3, "tl.dot")
    box(10.5, 1, 4.4, 6, "", "C2")
    rows = page // 4
    for k in range(4):  # the warps' bands: each holds whole token rows, so all heads of a token
        y = 7 - 1.5 * (k + 1)
        if k:
            ax.plot([10.5, 14.9], [y + 1.5, y + 1.5], ls="--", color="k", lw=0.7)
        ax.text(12.7, y + 0.75, f"warp {k}: tokens {rows * k}..{rows * k + rows - 1}\n× all {h} heads", ha="center",
                va="center", fontsize=8)
    ax.text(12.7, 7.3, f"S = [{page} tok, H] fp32", ha="center", fontsize=9)
    arrow(15.1, 17.3, "relu · w[h]")
    box(17.5, 1, 1.4, 6, "Σ over\nheads\n(inside\neach\nwarp)", "C4", fontsize=8)
    arrow(19.1, 21.3, "× k_scale")
    box(21.5, 1, 1.4, 6, f"{page}\nlogits\n(-inf\npast the\nbound)", "C3", fontsize=8)
    box(25, 1, 1.6, 6, f"k_scale\n[{page}]\nfp32", "C5", fontsize=8)
    ax.text(25.8, 0.5, f"the page's\nlast {page * 4} B", ha="center", va="top", fontsize=8)
    arrow(24.8, 23.1)
    ax.text(12.7, 8.6, "M = tokens (split over warps), N = heads (inside a warp), K = D", ha="center", fontsize=10)
    ax.set_title(f"One program, one page: K_page [{page}, D] × Qᵀ [D, H] → [{page}, H] → relu·w → Σ_h → ·k_scale → "
                 f"{page} logits")
    return fig


# ---------------------------------------------------------------- 05_triton_topk
def topk_against_context(contexts, timings, device_name: str):
    """Measured time against the context length, one line per (torch / package, index / score order)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for (name, t), style in zip(timings.items(), ["C0--", "C0-", "C1--", "C1-"], strict=True):
        ax.plot(contexts, t, style, marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="context length (scores per row)", ylabel="µs (median, graph replay)",
           title=f"Measured now on {device_name}: 64 rows, k = 2048")
    ax.set_xticks(contexts, [f"{n // 1024}K" for n in contexts])
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def topk_committed(picked: dict, shapes: list, result: dict):
    """The committed H200 top-k rows: torch and the package, index and score order, per shape."""
    fig, ax = plt.subplots(figsize=(10, 4))
    pos = np.arange(len(shapes))
    for i, (op, field, color, alpha) in enumerate([("topk(index)", "torch_us", "C0", 0.45),
                                                    ("topk(index)", "ours_us", "C0", 1.0),
                                                    ("topk(score)", "torch_us", "C1", 0.45),
                                                    ("topk(score)", "ours_us", "C1", 1.0)]):
        rows_op = [picked.get((s, op), {}) for s in shapes]
        base = next((r["baseline"] for r in rows_op if r.get("baseline")), "torch.topk")
        label = f"{base} (vs {op})" if field == "torch_us" else f"sparse_ref {op}"
        ax.bar(pos + (i - 1.5) * 0.2, [r.get(field, np.nan) for r in rows_op], 0.2, color=color, alpha=alpha,
               label=label)
    ks = {s: (picked.get((s, "topk(index)")) or picked.get((s, "topk(score)")) or {}).get("k") for s in shapes}
    ax.set_xticks(pos, [f"{s}\nk={ks[s]}" for s in shapes], fontsize=8)
    ax.set(ylabel="µs (median, L2 cold)",
           title=f"Committed H200 results, not measured now ({result.get('file')}: {result.get('gpu', '?')}, "
                 f"{str(result.get('date', '?'))[:16]}, randn rows)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def topk_context_sweep(result: dict, short_row: int):
    """The committed context sweep (``python -m sparse_ref.bench sweep``): µs against the row length at bs=1
    and bs=64, torch.topk on random rows dashed, the package on each distribution, and the row length up to
    which one program per row holds the row in registers (``short_row``)."""
    rows = [r for r in result.get("rows", []) if r.get("sweep") and r.get("op") == "topk(index)"]
    batches = sorted({int(r["shape"].split("x")[0]) for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(12, 3.8), sharey=True, squeeze=False)
    for ax, bs in zip(axes[0], batches, strict=True):
        mine = [r for r in rows if int(r["shape"].split("x")[0]) == bs]
        n_of = {id(r): int(r["shape"].split()[0].split("x")[1]) for r in mine}
        torch_rows = sorted((n_of[id(r)], r["torch_us"]) for r in mine if r["distribution"] == "randn")
        ax.plot(*zip(*torch_rows, strict=True), "k--", label="torch.topk(sorted=False), randn")
        for i, dist in enumerate(sorted({r["distribution"] for r in mine})):
            pts = sorted((n_of[id(r)], r["ours_us"]) for r in mine if r["distribution"] == dist)
            ax.plot(*zip(*pts, strict=True), marker="os^D"[i % 4], mfc="none", color=f"C{i}", label=f"topk, {dist}")
        ax.axvline(short_row * 1.4, color="0.6", lw=0.8)
        ax.text(short_row * 1.45, 0.97, "three launches →", fontsize=8, va="top", color="0.35",
                transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set(xlabel="scores per row (k = 2048)", title=f"bs = {bs}")
    axes[0][0].set_ylabel("µs (median, L2 cold)")
    axes[0][0].legend(fontsize=7.5, loc="upper left")
    fig.suptitle(f"The context sweep, index order (committed {result.get('gpu', '?')} results, "
                 f"{str(result.get('date', '?'))[:10]})")
    fig.tight_layout()
    return fig


def topk_launch_timeline(rows: list, grids: dict, result: dict):
    """The package top-k's launches one after another, one bar per shape: each launch as wide as its measured
    time (the bench's ``parts_us``); under each bar, every launch's time, programs and warps."""
    colours = {"delegates": "tab:blue", "candidates": "tab:orange", "select": "tab:green", "short_row": "tab:purple"}
    names = {"short_row": "one program a row, in registers"}
    fig, ax = plt.subplots(figsize=(12, 1.4 + 1.0 * len(rows)))
    for y, row in enumerate(rows):
        t, parts = 0.0, []
        for name, us in row["parts_us"].items():
            ax.barh(y, us, left=t, color=colours.get(name, "0.6"), edgecolor="white", height=0.45,
                    label=names.get(name, name) if y == 0 or name == "short_row" else None)
            programs, warps = grids[row["shape"]].get(name, ("?", "?"))
            parts.append(f"{names.get(name, name)} {us:.1f} µs ({programs} programs × {warps} warps)")
            t += us
        ax.text(t + 0.8, y, f"{row['ours_us']:.1f} µs in all (torch.topk {row['torch_us']:.1f})", va="center",
                fontsize=8.5)
        ax.text(0.5, y + 0.42, "  →  ".join(parts), va="center", fontsize=8.5, color="0.2")
    ax.set_yticks(range(len(rows)), [f"{r['shape'].split()[0]}\nk={r['k']}" for r in rows])
    ax.set_ylim(len(rows) - 0.35, -0.6)  # first shape on top; room for the last line of text
    ax.set_xlim(0, max(r["ours_us"] for r in rows) * 1.3)
    ax.set_xlabel("µs (each launch captured and replayed alone, L2 cold)")
    ax.set_title(f"The package top-k, launch by launch (committed {result.get('gpu', '?')} results, "
                 f"{str(result.get('date', '?'))[:10]}, randn rows, index order)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def use_lesson_kernels() -> str:
    """Put the repository's ``kernels/`` folder (the lesson kernels, one file per lesson) on ``sys.path``, found from
    the notebook's folder upward (``notebooks/`` or a student copy under ``build/``); return its path."""
    import sys
    from pathlib import Path

    here = Path.cwd().resolve()
    folder = next(str(p / "kernels") for p in (here, *here.parents) if (p / "kernels" / "radix_topk.py").is_file())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return folder


def show_lesson(*fns) -> None:
    """Print the whole source of each lesson function (a ``@triton.jit`` kernel or a launcher) with its file and
    line numbers: what the notebook runs is exactly what it shows."""
    import inspect
    for fn in fns:
        while hasattr(fn, "fn"):  # a @triton.jit kernel wraps the Python function
            fn = fn.fn
        lines, start = inspect.getsourcelines(fn)
        print(f"# kernels/{inspect.getsourcefile(fn).rsplit('/', 1)[-1]}, lines {start}-{start + len(lines) - 1}")
        for n, line in enumerate(lines):
            print(f"{start + n:4d} {line.rstrip()}")
        print()


def show_excerpt(fn, first: str, last: str) -> None:
    """Print the lines of ``fn``'s source from the first line containing ``first`` to the next containing ``last``,
    with their line numbers in the package file: an excerpt of the real code that cannot go stale."""
    import inspect
    while hasattr(fn, "fn"):  # a @triton.jit kernel (compiled or interpreted) wraps the Python function
        fn = fn.fn
    lines, start = inspect.getsourcelines(fn)
    i = next(n for n, line in enumerate(lines) if first in line)
    j = next(n for n in range(i, len(lines)) if lines[n].strip().startswith(last))
    path = inspect.getsourcefile(fn).split("sparse_ref/", 1)[-1]
    print(f"# sparse_ref/{path}, lines {start + i}-{start + j}")
    for n in range(i, j + 1):
        print(f"{start + n:4d} {lines[n].rstrip()}")


# ---------------------------------------------------------------- 07_end_to_end (the closing summary)
def decode_step_summary():
    """One decode step with SGLang's hook names: the per-step hooks, the per-layer loop (write path to
    attention_end, then the next layer), and each tensor's shape and dtype."""
    fig, ax = plt.subplots(figsize=(17, 6.0))
    ax.set_xlim(0, 16.6)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    w, h, step = 2.3, 1.75, 2.75
    top, low = 4.0, 0.5
    stages = [
        ((0.1, top), "forward_begin", "dense metadata, once\nper step (every page)\nForwardBatch DECODE:\n"
         "seq_lens int64 [bs]", "#eeeeee"),
        ((0.1 + step, top), "write path", "set_kv at out_cache_loc:\nk, v [bs, H_kv, D] into\nthe pool "
         "[pages·P, H_kv, D]\n(DSA: FP8 key + scale)", "#dbe9f6"),
        ((0.1 + 2 * step, top), "score", "attention_begin:\nQuest: fp32 [bs, pages]\nfrom [pages, H_kv, D]\n"
         "DSA: fp32 [tokens, ctx]", "#fde2c8"),
        ((0.1 + 3 * step, top), "select", "sink + top-k + recent\nselected int32 [bs, W]\n-1 padded; lengths "
         "[bs]\nW static: graph-safe", "#e2f0d9"),
        ((0.1 + 4 * step, top), "adaptor", "req_to_token: logical\n-> physical pages\npage_table int32 "
         "[bs, W']\nkv_lens int32 [bs]", "#e7dff2"),
        ((0.1 + 5 * step, top), "attention", "q [bs, H_q, D] over the\nselected pages; splits\n+ log-sum-exp "
         "merge\nout fp32 [bs, H_q, D]", "#f6d5d5"),
        ((0.1 + 5 * step, low), "attention_end", "Quest: the bounds of\nthe page this token\ncompleted", "#fde2c8"),
        ((0.1, low), "forward_end", "once per step, after\nthe last layer; then\ndecode_step grows\n"
         "every request", "#eeeeee"),
    ]
    anchors = [_box(ax, xy, w, h, title, body, color) for xy, title, body, color in stages]
    for (_, right), (left, _) in zip(anchors[:5], anchors[1:6], strict=True):
        _arrow(ax, right, left)
    x_attn = 0.1 + 5 * step + w / 2
    _arrow(ax, (x_attn, top - 0.02), (x_attn, low + h + 0.02))
    x_write = 0.1 + step + w / 2  # the next layer starts again at the write path
    ax.annotate("", xy=(x_write, top - 0.02), xytext=(anchors[6][0][0] - 0.02, low + h / 2),
                arrowprops={"arrowstyle": "->", "color": "0.25", "connectionstyle": "angle,angleA=180,angleB=-90"})
    ax.text(x_write + 0.1, low + h + 0.25, "next layer", fontsize=10, color="0.25")
    ax.text(9.6, 0.05, "forward_begin and forward_end run once per step; the write path to attention_end once per "
            "layer.\nEvery tensor keeps its shape from step to step, so the whole device half is captured once "
            "as a CUDA graph (GraphedDecodeStep).", ha="center", fontsize=10, style="italic", color="0.3")
    ax.set_title("The decode step you built: hooks, the write path, and what each stage hands on", fontsize=12)
    return fig


# ---------------------------------------------------------------- 09_decode_kernels
def split_softmax_mass(probs, slice_len: int, shares):
    """One head's attention probabilities as bars over the tokens, the background shaded by slice, each slice
    labelled with its share of the softmax mass (the merge's weight)."""
    probs = torch.as_tensor(probs).float().cpu()
    n = probs.shape[0]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for s, start in enumerate(range(0, n, slice_len)):
        end = min(start + slice_len, n)
        ax.axvspan(start - 0.5, end - 0.5, color=f"C{s}", alpha=0.12)
        ax.bar(range(start, end), probs[start:end], color=f"C{s}", width=0.8)
        ax.text((start + end - 1) / 2, float(probs.max()) * 1.08, f"slice {s}: {float(shares[s]):.1%} of the mass",
                ha="center", fontsize=8.5, color=f"C{s}", fontweight="bold")
    ax.set_ylim(0, float(probs.max()) * 1.22)
    ax.set(xlabel="token of the row", ylabel="softmax probability",
           title=f"Flash-decoding: {n} tokens split into slices of {slice_len}; the merge weighs each slice's "
                 "output by its mass")
    fig.tight_layout()
    return fig


def graph_against_eager(step: dict, result: dict):
    """The committed engine step: dense and sparse, eager and as one graph replay (milliseconds per step)."""
    bars = [("dense, eager", step["dense_eager_us"], "0.55"), ("sparse, eager", step["sparse_eager_us"], "tab:red"),
            ("dense, one graph", step["torch_us"], "0.3"), ("sparse, one graph", step["ours_us"], "tab:green")]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for y, (_, us, colour) in enumerate(bars):
        ax.barh(y, us / 1e3, color=colour)
        ax.text(us / 1e3 + 0.15, y, f"{us / 1e3:.2f} ms", va="center", fontsize=9)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, max(b[1] for b in bars) / 1e3 * 1.18)
    ax.set_xlabel("ms per decode step (L2 cold)")
    ax.set_title(f"One engine decode step, {step['shape']}\n(committed {result.get('gpu', '?')} results, "
                 f"{str(result.get('date', '?'))[:10]})", fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 10_offload
def memory_and_bandwidth(per_request: dict, hbm_tbps: float, pcie_gbps: float, copy_engine_gbps: float,
                         source: str):
    """Left: bytes per 128K request on the device and in host memory, all-on-device against offload. Right: the
    two bandwidths a decode step can read K/V through (log scale)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1.4, 1]})
    names = list(per_request)
    device = [per_request[n]["device"] / 2**20 for n in names]
    host = [per_request[n]["host"] / 2**20 for n in names]
    pos = np.arange(len(names))
    ax.bar(pos - 0.2, device, 0.4, color="C3", label="GPU memory (HBM)")
    ax.bar(pos + 0.2, host, 0.4, color="C0", label="host memory (pinned)")
    for x, d in zip(pos, device, strict=True):
        ax.text(x - 0.2, d, f"{d:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(pos, names)
    ax.set(ylabel="MiB per 128K-token request, per layer", title=f"Where a request's K/V lives ({source})")
    ax.legend(fontsize=8)
    bars = {"HBM copy\n(device to device)": hbm_tbps * 1000, "PCIe: copy engine\n(pinned -> device)": copy_engine_gbps,
            "PCIe: swap-in kernel\n(pinned, UVA reads)": pcie_gbps}
    bx.bar(range(3), list(bars.values()), color=["C3", "C0", "C2"])
    for x, v in enumerate(bars.values()):
        bx.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    bx.set_xticks(range(3), list(bars), fontsize=8)
    bx.set(yscale="log", ylabel="GB/s (log)", title="What a step can read K/V through")
    fig.tight_layout()
    return fig


def selection_reuse(curves: dict, steps: int):
    """Per decode step: the share of the tokens read that the previous step also read, and the hot buffer's hit
    rate, one pair of lines per algorithm."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, (name, c) in enumerate(curves.items()):
        ax.plot(range(2, steps + 1), c["reuse"], f"C{i}--", label=f"{name}: read by the previous step too")
        ax.plot(range(1, steps + 1), c["hit_rate"], f"C{i}-", marker="o", ms=3, label=f"{name}: hot-buffer hit rate")
    ax.set(xlabel="decode step", ylabel="share of the tokens read", ylim=(-0.02, 1.02),
           title="Why offload works: consecutive steps read mostly the same tokens")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def break_even(batches, device_tps, offload_tps, device_max: int, offload_max: int):
    """Tokens per second against the batch, each engine up to the batch that fits its memory."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.plot(batches[:device_max], device_tps[:device_max], "C3-", label=f"all on the device (fits {device_max})")
    ax.plot(batches[:offload_max], offload_tps[:offload_max], "C2-", label=f"offload (fits {offload_max})")
    best = device_tps[device_max - 1]
    ax.axhline(best, color="C3", ls=":", lw=1, label="the device's best")
    even = next((b for b, t in zip(batches[:offload_max], offload_tps[:offload_max], strict=False)
                 if b > device_max and t > best), None)  # the first batch where offload beats it
    if even is not None:
        ax.axvline(even, color="C2", ls="--", lw=1)
        ax.annotate(f"break-even: {even} requests", (even, best), (12, -28), textcoords="offset points",
                    fontsize=9, color="C2", arrowprops=dict(arrowstyle="->", color="C2"))
    ax.set(xlabel="requests in the batch", ylabel="decode tokens / s (model)",
           title="The break-even batch: where offload's larger batch beats the device's best")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def stale_row_image(req_to_token, pages_of_requests, seq_lens, rows, page_size: int):
    """req_to_token as an image, each slot coloured by the request owning its page (``pages_of_requests``: each
    request's physical pages), pale past each row's length (a black bar): a reused row's stale tail stands out."""
    from matplotlib.colors import ListedColormap

    pages = max([int(req_to_token.max()) // page_size] + [max(p, default=0) for p in pages_of_requests]) + 1
    owner = torch.zeros(pages, dtype=torch.long)  # physical page -> request + 1, 0 = nobody
    for i, owned in enumerate(pages_of_requests):
        owner[torch.tensor(owned)] = i + 1
    show = min(req_to_token.shape[1], max(2048, max(seq_lens) + 1024))  # enough to see the stale tails
    img = 2 * owner[(req_to_token[:, :show].long().cpu() // page_size)].numpy()
    for row, n in zip(rows, seq_lens, strict=True):  # odd values: past the row's length (drawn pale)
        img[row, n:] += 1
    fig, ax = plt.subplots(figsize=(11, 2.6))
    cmap = ListedColormap(["white", "white", "tab:blue", "#c6dbef", "tab:orange", "#fdd0a2", "tab:green",
                           "#c7e9c0", "tab:red", "#fcbba1"])  # per request: solid, then pale past seq_len
    ax.imshow(img, aspect="auto", cmap=cmap, vmin=-0.5, vmax=9.5, interpolation="nearest")
    total = img.shape[0]
    for row, n in zip(rows, seq_lens, strict=True):
        ax.axvline(n, ymin=1 - (row + 1) / total, ymax=1 - row / total, color="k", lw=2)
    ax.set_xlabel("logical token position t")
    ax.set_ylabel("req_to_token row")
    ax.set_title("req_to_token: colour = request that owns the slot's page (white = padding page 0); "
                 "pale = past seq_len (black bar)")
    return fig


def causal_scores(scores, selected, shown: int, topk: int):
    """The indexer's causal score matrix of a prompt (first ``shown`` tokens), beside the positions each token
    keeps."""
    img = scores[:shown, :shown].cpu().clone()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    im = axes[0].imshow(img.masked_fill(torch.isinf(img), float("nan")), cmap="viridis", interpolation="nearest")
    axes[0].set(title=f"index scores I[t, s] (first {shown} tokens)", xlabel="key position s", ylabel="query token t")
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    mask = torch.zeros(shown, shown)
    for t in range(shown):
        kept = selected[t][selected[t] >= 0].cpu()
        mask[t, kept[kept < shown]] = 1
    axes[1].imshow(mask, cmap="Greys", interpolation="nearest")
    axes[1].set(title=f"selected positions (top {topk} per row)", xlabel="key position s")
    fig.suptitle("The lightning indexer on the prompt: causal index scores, and the top-k each token keeps")
    fig.tight_layout()
    return fig


def radix_round_zero(hist0, at_or_above, digit0: int, k: int, n: int):
    """Round 0 of a radix select on one row: keys per top digit (log scale), the running count from the top, the
    threshold's bin (red) and the bins surely in (green)."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    colors = ["C3" if b == digit0 else ("C2" if b > digit0 else "C0") for b in range(256)]
    ax.bar(range(256), hist0.numpy(), color=colors, width=1.0)
    ax.step(range(256), at_or_above.numpy(), where="mid", color="k", lw=0.8, label="keys in this bin or higher")
    ax.axhline(k, color="C3", ls=":", label=f"k = {k}")
    ax.set(title=f"Round 0 on a randn row of {n}: the threshold's top digit is bin {digit0} (red); "
                 "green bins are surely in", xlabel="top digit of the key", ylabel="keys", yscale="log",
           xlim=(digit0 - 14, digit0 + 6))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def hot_buffer_row(token, last_used, slot_of, clock: int, seq_len: int):
    """One request row of the hot buffer after a step: its slots (the token each holds; read this step, held from
    before, or empty) and the reserved slot of the newest token, above the row's slot table (token -> slot)."""
    from matplotlib.patches import Rectangle

    size = len(token)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 3.6), gridspec_kw={"height_ratios": [1, 1.1]})
    kinds = {"read this step": "tab:green", "held from before": "#9ecae1", "empty": "white",
             "reserved: the newest token": "tab:purple"}
    for s in range(size + 1):
        if s == size:
            kind, label = "reserved: the newest token", f"t={seq_len - 1}"
        elif token[s] < 0:
            kind, label = "empty", "-"
        else:
            kind, label = ("read this step" if last_used[s] == clock else "held from before"), f"t={token[s]}"
        top.add_patch(Rectangle((s, 0), 1, 1, facecolor=kinds[kind], edgecolor="k"))
        top.text(s + 0.5, 0.5, label, ha="center", va="center", fontsize=8,
                 color="w" if kind.startswith("reserved") else "k")
    top.set(xlim=(0, size + 1), ylim=(0, 1), yticks=[], xticks=[s + 0.5 for s in range(size + 1)],
            xticklabels=[str(s) for s in range(size)] + ["B"], title="the row's hot slots (slot id below)")
    top.legend(handles=[Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="k", label=k) for k, c in kinds.items()],
               fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, frameon=False)
    held = [(t, int(slot_of[t])) for t in range(seq_len) if slot_of[t] >= 0]
    bottom.broken_barh([(t, 1) for t, _ in held], (0, 1), facecolors="tab:blue")
    for t, s in held:
        bottom.text(t + 0.5, 1.15, str(s), ha="center", fontsize=7)
    bottom.set(xlim=(0, seq_len), ylim=(0, 1.6), yticks=[], xlabel="token position t",
               title="slot_of: the slot each held token is in (blank: on the host only; the newest: slot B)")
    fig.suptitle(f"One row of the hot buffer after a step: {size} slots plus the reserved one")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 07_end_to_end
METHOD_STYLE = {"dense": {"fmt": "k-", "mfc": None}, "quest (mean)": {"fmt": "o-", "mfc": None},
                "quest (per_kv_head)": {"fmt": "s--", "mfc": "none"}, "dsa": {"fmt": "^:", "mfc": None}}


def accuracy_against_budget(rows, methods, context: int):
    """Recall, needles kept, mass kept and output error against the token budget, one line per method: open
    markers and dashes, and one legend under the panels, so that no line hides another."""
    fields = [("recall", "recall of the true top pages / tokens"), ("needles_found", "planted needles kept"),
              ("mass_kept", "attention mass kept"), ("output_error", "relative output error")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for label in methods:
        mine, style = [r for r in rows if r.method == label], METHOD_STYLE[label]
        for ax, (field, title) in zip(axes, fields, strict=True):
            ax.plot([r.budget for r in mine], [getattr(r, field) for r in mine], style["fmt"], label=label,
                    mfc=style["mfc"])
            ax.set(title=title, xscale="log", xlabel="budget (tokens per request)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(methods), frameon=False)
    fig.suptitle(f"Accuracy against budget, {context}-token requests")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def step_time_against_context(contexts, times: dict, title: str, ylabel: str):
    """Milliseconds per decode step against the context (log-log), one line per method, each its own style."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for label, ms in times.items():
        ax.plot(contexts, ms, METHOD_STYLE[label]["fmt"], label=label, mfc=METHOD_STYLE[label]["mfc"])
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 00-04: figures moved out of the lesson cells
def page_scores_kept(scores, num_pages: int, best, page_size: int, seq_len: int, kept: int):
    """One request's page scores as bars: the sink, the best history pages and the recent ones coloured as kept."""
    fig, ax = plt.subplots(figsize=(11, 2.8))
    role = ["sink" if p == 0 else "recent" if p >= num_pages - 2 else "top-k" if p in best else "skipped"
            for p in range(num_pages)]
    colors = {"sink": "#4c72b0", "recent": "#55a868", "top-k": "#dd8452", "skipped": "#cccccc"}
    ax.bar(range(num_pages), scores, color=[colors[r] for r in role], edgecolor="0.3")
    for name, c in colors.items():
        ax.bar([0], [0], color=c, label=name)
    ax.axhline(0, color="0.3", linewidth=0.8)
    ax.set_xticks(range(num_pages))
    ax.set(xlabel=f"logical page (P = {page_size} tokens; the request has {seq_len} tokens)", ylabel="page score",
           title=f"kept {kept} of {num_pages} pages: attention reads {kept / num_pages:.0%} of the KV")
    ax.legend(ncol=4, fontsize=8, loc="lower left")
    return fig


def pages_kept_per_request(img, needle_pages, config, page_size: int):
    """One row per request along its logical pages (``img``: 0 past the sequence, 1 not read, 2 sink, 3 top-k,
    4 recent), crosses on the planted needle pages."""
    from matplotlib.colors import ListedColormap

    fig, ax = plt.subplots(figsize=(11, 2.8))
    ax.imshow(img, aspect="auto", interpolation="nearest",
              cmap=ListedColormap(["white", "#e0e0e0", "tab:purple", "tab:orange", "tab:green"]), vmin=-0.5, vmax=4.5)
    for i, needles in enumerate(needle_pages):
        ax.scatter(needles, [i] * len(needles), marker="x", color="k", s=30, label="planted needle" if i == 0 else None)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:purple", "tab:orange", "tab:green", "#e0e0e0")]
    ax.legend(handles + [ax.collections[0]], ["sink", "top-k (Quest)", "recent", "not read", "planted needle"],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5)
    ax.set(xlabel="logical page", ylabel="request",
           title=f"Pages kept per request (page {page_size}, budget {config.page_budget}, "
                 f"{config.num_sink_pages} sink, {config.num_recent_pages} recent)")
    return fig


def bound_against_true_max(best_dot, bound):
    """Quest's bound against the true max of q·k over each page's keys: every point on or above the diagonal."""
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(best_dot.flatten(), bound.flatten(), s=3, alpha=0.4)
    lim = [float(best_dot.min()), float(bound.max())]
    ax.plot(lim, lim, "k--", lw=1, label="bound = true max")
    ax.set(xlabel="true max of q·k over the page's keys", ylabel="Quest bound",
           title="Every point lies above the diagonal")
    ax.legend()
    return fig


def quantisation_error(sizes, errors: dict, head_dim: int):
    """Relative error of q·k after FP8 and INT8 round trips as one outlier channel grows, with and without a
    Hadamard rotation first (``errors[grid, rotated]``)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, grid in zip(axes, ("FP8 e4m3", "INT8"), strict=True):
        ax.semilogx(sizes, errors[grid, False], "o-", label="no rotation")
        ax.semilogx(sizes, errors[grid, True], "s--", mfc="none", label="Hadamard rotation first")
        ax.set(title=f"{grid}, one scale per {head_dim}-value vector", xlabel="outlier channel size (x a typical "
               "channel)")
        ax.legend()
    axes[0].set_ylabel("relative error of q·k")
    fig.tight_layout()
    return fig


def fp8_score_error(ratio, overlap):
    """Histograms: the FP8 scores' error against the bound B, and each query token's top-k overlap with fp32."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    axes[0].hist(ratio.cpu().numpy(), bins=50)
    axes[0].set(xlabel="|I_fp8 - I_fp32| / B", ylabel="(t, s) pairs")
    axes[1].hist(overlap.cpu().numpy(), bins=20, range=(0.5, 1.0))
    axes[1].set(xlabel="top-k overlap, FP8 vs full precision", ylabel="query tokens")
    fig.tight_layout()
    return fig


def key_page_bytes(page_size: int, head_dim: int):
    """One page of the indexer key cache as a strip of bytes: the keys (token-major), then the fp32 scales."""
    P, D = page_size, head_dim
    fig, ax = plt.subplots(figsize=(11, 1.9))
    colors = plt.cm.viridis(np.linspace(0, 1, P))
    for t in range(P):
        ax.barh(0, D, left=t * D, color=colors[t], edgecolor="white", linewidth=0.3)
        ax.barh(0, 4, left=P * D + 4 * t, color=colors[t], edgecolor="black", linewidth=0.3, hatch="//")
    ax.axvline(P * D, color="red")
    ax.set(title=f"one page of the indexer key cache: {P} keys of {D} FP8 bytes, then {P} fp32 scales "
                 f"({P * (D + 4)} bytes; same colour = same token)", xlabel="byte offset in the page", yticks=[])
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 05_triton_topk: figures out of the lesson cells
def topk_pass_costs(costs, cheap, read_us: float):
    """Measured costs of top-k building blocks as horizontal bars (log scale), the cheap ones green."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    names, us = zip(*costs, strict=True)
    ax.barh(names, us, color=["C2" if any(c in n for c in cheap) else "C3" for n in names])
    ax.axvline(read_us, color="k", ls=":", lw=1, label=f"one plain read of the input ({read_us} µs)")
    for i, v in enumerate(us):
        ax.text(v * 1.05, i, f"{v:g}", va="center", fontsize=8)
    ax.set(xscale="log", xlabel="µs (H200, median, L2 flushed)", xlim=(5, 700),
           title="Measured on an H200: what a Triton top-k pass costs over 64 x 64K fp32 (green: free over the read)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return fig


def delegate_threshold(row, cand, top, threshold: float, delegates, k: int, g: int):
    """Left: a row, its candidates above the delegate threshold and its top-k. Right: the row as [N/G, G] with
    each column's maximum (its delegate) marked, the k largest in red."""
    n = row.shape[0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    ax, ids = axes[0], torch.arange(n)
    ax.scatter(ids[~cand], row[~cand], s=5, color="0.7", label="below T")
    ax.scatter(ids[cand], row[cand], s=14, color="C1", label=f"candidates x >= T ({int(cand.sum())})")
    ax.scatter(ids[top], row[top], s=40, facecolors="none", edgecolors="C3", label=f"the top-{k}")
    ax.axhline(threshold, color="k", ls=":", label="T = k-th largest delegate")
    ax.set(title=f"a row of {n}: candidates above the delegate threshold", xlabel="id", ylabel="score")
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[1]
    view = row.view(n // g, g)
    ax.imshow(view.numpy(), aspect="auto", cmap="viridis")
    arg, in_top = view.argmax(dim=0), delegates >= threshold
    ax.scatter(torch.arange(g)[~in_top], arg[~in_top], s=8, color="w", label="delegate (column max)")
    ax.scatter(torch.arange(g)[in_top], arg[in_top], s=18, color="C3", label=f"the {k} largest delegates")
    ax.set(title=f"the same row as [N/G, G] = [{n // g}, {g}]", xlabel="column j (ids j, j+G, ...)",
           ylabel="sub-range row")
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Delegate threshold: one max per strided sub-range, T = the k-th largest of them")
    fig.tight_layout()
    return fig


def candidates_per_row(counts: dict, slots: int, k: int, n: int, g: int):
    """Candidates per row for several kinds of rows (log scale): red ones overflow the slots."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.bar(list(counts), list(counts.values()), color=["C2" if c <= slots else "C3" for c in counts.values()])
    for i, c in enumerate(counts.values()):
        ax.text(i, c * 1.08, str(c), ha="center", fontsize=8)
    ax.axhline(slots, color="k", ls=":", label=f"slots per row = G = {slots}")
    ax.axhline(k, color="C0", ls="--", lw=0.8, label=f"k = {k}")
    ax.set(yscale="log", ylabel="candidates x >= T", ylim=(1000, 150000),
           title=f"Candidates per row of {n} (k = {k}, G = {g}): red rows need the exact fallback")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bitmask_words(bits, popc, starts, n_bits: int, k: int, g: int, m: int):
    """A row's candidate bitmask as a grid of words, each word's popcount and first slot written beside it."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.imshow(bits.numpy(), cmap="Greys", aspect="auto", vmin=0, vmax=1)
    for w in range(n_bits // 32):
        ax.text(32.5, w, f"popc {int(popc[w])}, starts at slot {int(starts[w])}", va="center", fontsize=8)
    ax.set(title=f"Bitmask of a row of {n_bits} (k = {k}, G = {g}): {m} candidates, one bit each",
           xlabel="bit b (element 32 w + b)", ylabel="word w", xlim=(-0.5, 48))
    fig.tight_layout()
    return fig


def thresholds_compared(passed: dict):
    """Candidates each threshold lets through (``passed[row kind] = (16-bit cut, window rounds)``), log scale."""
    fig, ax = plt.subplots(figsize=(9, 3.4))
    pos = np.arange(len(passed))
    ax.bar(pos - 0.2, [c for c, _ in passed.values()], 0.4, label="k-th delegate cut to 16 bits (two radix rounds)")
    ax.bar(pos + 0.2, [w for _, w in passed.values()], 0.4, label="window rounds over the delegates' own range")
    ax.set_xticks(pos, list(passed), fontsize=8)
    ax.set(yscale="log", ylabel="candidates x >= T", title="Candidates let through by each threshold")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def topk_by_distribution(per_dist: dict, names, baseline: str, source: str):
    """torch.topk against the package top-k in index order, per score distribution, as paired bars."""
    pos = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(pos - 0.2, [per_dist[d][0] for d in names], 0.4, color="C0", alpha=0.45, label=baseline)
    ax.bar(pos + 0.2, [per_dist[d][1] for d in names], 0.4, color="C0", label="topk order='index'")
    ax.set_xticks(pos, names)
    ax.set(ylabel="µs (median)", title=f"64 x 64K, k = 2048, by score distribution: {source}",
           ylim=(0, 1.3 * max(max(v) for v in per_dist.values())))
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 06_triton_scoring: figures out of the lesson cells

def key_page_layouts(page: int, d: int):
    """The same bytes of one DSA key page coloured by token, twice: as rows of ``d`` bytes (the real layout: the
    keys, then the scales) and as the API shape's rows of ``d + 4`` bytes, which are not tokens."""
    byte = np.arange(page * (d + 4))
    owner = np.where(byte < page * d, byte // d, (byte - page * d) // 4)  # the token of each byte
    is_scale = byte >= page * d
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, width, title in ((axes[0], d, f"real layout: {page * (d + 4) // d} rows of {d} B"),
                             (axes[1], d + 4, f"the API shape [{page}, 1, {d + 4}]: rows are not tokens")):
        rows = len(byte) // width
        colour = (owner % 10).reshape(rows, width)  # neighbouring tokens get different colours
        ax.imshow(np.ma.masked_array(colour, is_scale.reshape(rows, width)), cmap="tab10", vmin=0, vmax=9,
                  aspect="auto", interpolation="nearest")
        ax.imshow(np.ma.masked_array((owner % 2).reshape(rows, width), ~is_scale.reshape(rows, width)), cmap="Greys",
                  vmin=-2, vmax=1.5, aspect="auto", interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("byte within the row")
        ax.set_ylabel("row")
    axes[0].annotate(f"{page} keys: row i = token i ({d} FP8 bytes)", (d / 2, page / 2 - 2), color="k", ha="center",
                     fontsize=9, bbox=dict(fc="w", alpha=0.8))
    axes[0].annotate(f"{page} fp32 scales (grey): 4 B each", (d / 2, page + 0.5), (d / 2, page - 6), ha="center",
                     fontsize=9, bbox=dict(fc="w", alpha=0.8), arrowprops=dict(arrowstyle="->"))
    axes[1].annotate("each row starts 4 B later than a token:\nit holds pieces of two tokens' keys,\n"
                     "and the last rows read scales", (d / 2 + 2, 20),
                     ha="center", fontsize=9, bbox=dict(fc="w", alpha=0.8))
    fig.suptitle("One DSA key page: each byte coloured by its token (10 colours in turn, so neighbours differ; grey: "
                 "the scales, alternating by token)")
    fig.tight_layout()
    return fig


def speed_against_floor(rows, title: str):
    """``rows``: (label, {series: microseconds}, floor_us). Left: time per call (log) with the byte floor marked;
    right: the floor as a share of each time."""
    labels = [r[0] for r in rows]
    series = sorted({name for r in rows for name in r[1]})
    x = np.arange(len(rows))
    width = 0.8 / max(len(series), 1)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for i, name in enumerate(series):
        t = [r[1].get(name, np.nan) for r in rows]
        axes[0].bar(x + (i - (len(series) - 1) / 2) * width, t, width, label=name)
        axes[1].bar(x + (i - (len(series) - 1) / 2) * width, [100 * r[2] / v for r, v in zip(rows, t, strict=True)],
                    width, label=name)
    axes[0].scatter(x, [r[2] for r in rows], marker="_", s=600, color="k", zorder=3, label="byte floor")
    axes[0].set(ylabel="µs (median, L2 cold)", yscale="log", title=title)
    axes[1].axhline(100, color="k", lw=0.8)
    axes[1].set(ylabel="byte floor / time (%)", ylim=(0, 110), title="share of the floor reached")
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def accuracy_against_context(by_context: dict, contexts, fields, budget: int):
    """Needles kept, mass kept and output error against the context length at a fixed budget, one line a method."""
    fig, axes = plt.subplots(1, len(fields), figsize=(13, 3.8))
    for label, runs in by_context.items():
        style = METHOD_STYLE[label]
        for ax, (field, title) in zip(axes, fields, strict=True):
            ax.plot(contexts, [getattr(r, field) for r in runs], style["fmt"], label=label, mfc=style["mfc"])
            ax.set(title=title, xlabel="context (tokens)")
            ax.set_xscale("log", base=2)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(by_context), frameon=False)
    fig.suptitle(f"Accuracy against context length, budget {budget} tokens")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def needle_against_depth(found: dict, depths, budget: int, context: int):
    """The share of requests that kept a single weak needle, against its depth in the prompt, one line a method."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for label, rate in found.items():
        ax.plot(depths, rate, METHOD_STYLE[label]["fmt"], label=label, mfc=METHOD_STYLE[label]["mfc"])
    ax.set(xlabel="needle depth (fraction of the prompt)", ylabel="share of requests that kept it",
           title=f"Is a weak needle found? budget {budget} tokens, {context}-token prompt")
    ax.legend()
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 05 and 09: a kernel's memory traffic
MASKED_OFF, OUTSIDE = -2, -3  # what an image entry holds beside a program's number (-1: nothing touched it)


def trace_memory(kernel, grid, *args, **constexprs) -> dict:
    """Run ``kernel[grid](*args, **constexprs)`` (CPU tensors) through Triton's interpreter, recording every load
    and store: ``{argument name: int [2, numel + 16]}`` per tensor argument (flattened), row 0 loads and row 1
    stores, each entry the program (flattened grid index) that touched it last, ``MASKED_OFF`` for a masked lane
    past the tensor's end, ``OUTSIDE`` for an unmasked access past it, -1 untouched."""
    from triton.runtime.interpreter import InterpreterBuilder

    records, load, store = [], InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def record(kind, builder, ptrs, mask):
        records.append((kind, builder.grid_idx, ptrs.data.astype(np.int64).ravel(),
                        np.broadcast_to(mask.data, ptrs.data.shape).ravel().astype(bool)))

    def traced_load(self, ptrs, mask, *rest):
        record(0, self, ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def traced_store(self, ptrs, value, mask, *rest):
        record(1, self, ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = traced_load, traced_store
    try:
        kernel[grid](*args, **constexprs)
    finally:
        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = load, store
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    images = {}
    for name, t in zip(kernel.arg_names, args, strict=False):
        if not isinstance(t, torch.Tensor):
            continue
        n, image = t.numel(), np.full((2, t.numel() + 16), -1)
        for kind, (x, y, z), ptrs, mask in records:
            idx = (ptrs - t.data_ptr()) // t.element_size()
            near = (idx >= 0) & (idx < n + 16)
            image[kind, idx[near & mask & (idx < n)]] = x + grid3[0] * (y + grid3[1] * z)
            image[kind, idx[near & ~mask & (idx >= n)]] = MASKED_OFF
            image[kind, idx[near & mask & (idx >= n)]] = OUTSIDE
        images[name] = image
    return images


def show_memory_traffic(kernel, grid, *args, title: str, **constexprs) -> None:
    """``trace_memory``'s picture: for each tensor argument, which program loaded (top row) and stored (bottom row)
    each element, a colour per program, masked-off lanes grey past the tensor's end, an unmasked access outside
    the tensor red. Where kernels are compiled for a GPU it says so in one line instead."""
    from matplotlib.colors import ListedColormap

    from sparse_ref.device import triton_interpreted

    if not triton_interpreted():
        print("(the memory picture runs the kernel through Triton's interpreter: run this notebook on a CPU to see it)")
        return
    images = trace_memory(kernel, grid, *args, **constexprs)
    programs = int(np.prod(grid))
    colours = ListedColormap(["tab:red", "0.85"] + [plt.get_cmap("tab20")(i % 20) for i in range(programs)])
    fig, axes = plt.subplots(len(images), 1, figsize=(12, 1.3 * len(images) + 0.6), squeeze=False)
    for ax, (name, image) in zip(axes[:, 0], images.items(), strict=True):
        n = image.shape[1] - 16
        used = max(n, int(np.nonzero((image != -1).any(0))[0].max(initial=-1)) + 1)
        part = image[:, :used]  # colour index: OUTSIDE 0, MASKED_OFF 1, program p at p + 2; untouched blank
        shown = np.where(part == -1, np.nan, np.where(part >= 0, part + 2, part - OUTSIDE))
        ax.imshow(shown, aspect="auto", cmap=colours, vmin=0, vmax=programs + 1, interpolation="nearest")
        ax.axvline(n - 0.5, color="black", linewidth=1.5)
        ax.set_yticks([0, 1], ["loaded", "stored"])
        ax.set_title(f"{name}: {n} elements (the black line is its end)", fontsize=9, loc="left")
        ax.set_xlabel("element (flattened)", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"{title}: a colour per program, grey masked off, red outside the tensor", fontsize=11)
    fig.tight_layout()
    show_figure(fig, f"{title}. For each tensor argument of the kernel, two strips of its elements, loaded and "
                f"stored, coloured by the program of the {programs} that touched each; lanes masked off past a "
                "tensor's end are grey, and an access outside a tensor without a mask would be red.")
