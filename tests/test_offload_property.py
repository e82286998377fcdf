"""The offload engine equals the all-on-device engine, and no request's hot-buffer rows change through another's
call (a property).

A hypothesis state machine builds a pair of engines (all on the device; offloaded with a hot buffer from just big
enough upward, fp32 or bf16, the reference swap-in or the kernel) and drives both through joins, leaves (rows
and pages reused) and steps. Every step: the same outputs bit for bit, the same selections, the same K/V read.
Every join and leave: the other live requests' hot rows (held tokens, slot table, LRU state and the K/V in their
slots) are unchanged; every step: the rows no request holds stay empty.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_offload import INDEXER, LAYERS, P, assert_hot_matches_host, gathered

import sparse_ref
from sparse_ref import offload
from sparse_ref.config import SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.errors import SparseRefError
from sparse_ref.workloads import PlantedEngineWorkload

DEVICE = sparse_ref.default_device()
CONTEXT = 48


def pair(extra: int, dtype, backend: str):
    """The two engines, the offloaded one with a hot buffer ``extra`` slots past the smallest it accepts."""
    wl = PlantedEngineWorkload(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=17)
    cfg = SparseConfig(page_budget=2, num_recent_pages=1, num_sink_pages=1, min_sparse_seq_len=12)
    kw = dict(dsa_topk=8, page_size=P, max_requests=3, max_context_len=CONTEXT, backend=backend, dtype=dtype,
              device=DEVICE if backend == "triton" else "cpu")
    base = DecodeEngine(wl, LAYERS, cfg, **kw)
    c = base.coordinator
    smallest = offload.most_tokens_read(c.algorithms, c.configs, [0, 1], 8, P, CONTEXT)
    return base, DecodeEngine(wl, LAYERS, cfg, offload_buffer=smallest + extra, **kw), smallest


def row_state(hot, row: int):
    """Everything the hot buffer keeps for one request row, every layer."""
    slots = slice(hot.base(row), hot.base(row) + hot.width)
    kv = [t[slots].cpu().clone() for t in hot.k + hot.v if t is not None]
    return [getattr(hot, name)[:, row].cpu().clone() for name in ("token", "last_used", "slot_of", "lru")] + kv


class OffloadEquality(RuleBasedStateMachine):
    @initialize(extra=st.integers(0, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
                backend=st.sampled_from(["torch", "triton"]))
    def start(self, extra, dtype, backend):
        self.base, self.off, smallest = pair(extra, dtype, backend)
        assert self.off.offload.hot.size == smallest + extra
        self.steps = 0

    def others(self, skip=None):
        """The hot state of every live request's row but ``skip``'s."""
        hot = self.off.offload.hot
        return {r.req_pool_idx: row_state(hot, r.req_pool_idx) for r in self.off.live if r is not skip}

    def unchanged(self, before, after):
        assert before.keys() == after.keys()
        for row in before:
            assert all(torch.equal(a, b) for a, b in zip(before[row], after[row], strict=True)), row

    @rule(n=st.integers(1, 40))
    def join(self, n):
        before, outcomes = self.others(), []
        for e in (self.base, self.off):
            try:
                e.add_request(n)
                outcomes.append("ok")
            except SparseRefError as err:  # no free row or pages: refused by both, nothing changed
                outcomes.append(type(err).__name__)
        assert outcomes[0] == outcomes[1], outcomes
        self.unchanged(before, {row: s for row, s in self.others().items() if row in before})

    @precondition(lambda self: self.off.live)
    @rule(data=st.data())
    def leave(self, data):
        i = data.draw(st.integers(0, len(self.off.live) - 1))
        leaving = self.off.live[i]
        before = self.others(skip=leaving)
        self.base.finish(self.base.live[i])
        self.off.finish(leaving)
        self.unchanged(before, self.others())
        assert row_state(self.off.offload.hot, leaving.req_pool_idx)[0].eq(-1).all()  # the row starts empty

    @precondition(lambda self: self.off.live and all(r.seq_len < CONTEXT for r in self.off.live))
    @rule()
    def step(self):
        hot = self.off.offload.hot
        free = set(range(hot.token.shape[1])) - {r.req_pool_idx for r in self.off.live}
        empty = {row: row_state(hot, row) for row in free}
        a, b = self.base.step(), self.off.step()
        self.steps += 1
        pool = self.base.manager.token_to_kv_pool
        for ta, tb in zip(a.layers, b.layers, strict=True):
            assert torch.equal(ta.out, tb.out), (self.steps, ta.layer)
            if tb.offload is None:
                continue
            assert torch.equal(ta.metadata.selected, tb.metadata.selected)
            kv = (pool.get_key_buffer(ta.layer), pool.get_value_buffer(ta.layer))
            want = gathered(self.base, ta, ta.metadata, kv)
            got = gathered(self.off, tb, tb.offload, (hot.k[tb.layer], hot.v[tb.layer]))
            for (ka, va), (kb, vb) in zip(want, got, strict=True):
                assert torch.equal(ka, kb) and torch.equal(va, vb), (self.steps, ta.layer)
        self.unchanged(empty, {row: row_state(hot, row) for row in free})

    @invariant()
    def held_slots_equal_the_host_pool(self):
        if hasattr(self, "off"):
            assert_hot_matches_host(self.off)


OffloadEquality.TestCase.settings = settings(max_examples=15, stateful_step_count=15, deadline=None)
TestOffloadEquality = OffloadEquality.TestCase
