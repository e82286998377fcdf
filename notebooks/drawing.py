"""Figures the notebooks draw, one function per figure, so that the lessons' cells hold the lesson.

Each function returns a matplotlib figure with a title; the notebook shows it with
``sparse_ref.figures.show_figure(fig, alt)``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


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
