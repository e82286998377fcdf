"""No request's K/V, req_to_token row or Quest bounds change through another request's call (a property).

A hypothesis state machine drives one ``DecodeEngine`` (a Quest layer and a DSA layer) through admit
(``add_request``), step, finish, same-shape re-admission after a finish, stale batches from before it,
``manager.grow`` outside the engine, frees of a live request's pages and rows, and graph steps with
replays. After every call, every request that the call did not concern keeps its tokens' K/V, its
req_to_token row and its pages' bounds exactly; a step appends one token per request and changes
nothing before it. Every refused call (a project error) must leave everything as it was.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_ref.batch import decode_step
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.engine_graph import GraphedDecodeStep
from sparse_ref.errors import SparseRefError
from sparse_ref.workloads import PlantedEngineWorkload

INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)
P = 4


def engine():
    wl = PlantedEngineWorkload(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=1,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=11)
    return DecodeEngine(wl, ["quest", "deepseek_dsa"], SparseConfig(page_budget=2, min_sparse_seq_len=8),
                        dsa_topk=8, page_size=P, max_requests=3, max_context_len=40, num_pages=26,
                        backend="torch", compare_dense=False)


class EngineIsolation(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.e = engine()
        self.saved = {}  # rid -> what its tokens hold: the row, K/V per layer, Quest bounds of its full pages
        self.stale = self.last = None  # a batch built before a finish / admit (must be refused by forward)
        self.graph = None

    # ------------------------------------------------------------ what each request holds
    def snapshot(self, req):
        m, quest = self.e.manager, self.e.coordinator.algorithms[0]
        n = self.e.written[req.rid]
        row = m.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone()
        slots = row.long()
        pool = m.token_to_kv_pool
        kv = [(pool.get_key_buffer(layer)[slots].clone(), pool.get_value_buffer(layer)[slots].clone())
              for layer in range(2)]
        full = torch.tensor(req.pages[: n // P], dtype=torch.long)
        bounds = (quest.page_min[0][full].clone(), quest.page_max[0][full].clone(), quest.page_valid[0][full].clone())
        return n, row, kv, bounds

    def same(self, a, b) -> bool:
        return a[0] == b[0] and torch.equal(a[1], b[1]) and all(
            torch.equal(x, y) for pair_a, pair_b in zip(a[2], b[2], strict=True) for x, y in zip(pair_a, pair_b,
                                                                                                   strict=True)) \
            and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))

    def save_all(self):
        self.saved = {r.rid: self.snapshot(r) for r in self.e.live}

    def check_untouched(self, except_rids=()):
        for r in self.e.live:
            if r.rid in self.saved and r.rid not in except_rids:
                assert self.same(self.snapshot(r), self.saved[r.rid]), f"request {r.rid} changed"

    def check_prefix_kept(self):
        """After a step: each request's earlier tokens hold what they held; one more token was written."""
        for r in self.e.live:
            n, row, kv, bounds = self.saved[r.rid]
            now = self.snapshot(r)
            assert now[0] == n + 1 and torch.equal(now[1][:n], row)
            for (k0, v0), (k1, v1) in zip(kv, now[2], strict=True):
                assert torch.equal(k1[:n], k0) and torch.equal(v1[:n], v0)

    # ------------------------------------------------------------ rules
    @rule(n=st.integers(1, 30), same_shape=st.booleans())
    def admit(self, n, same_shape):
        if same_shape and self.e.live:  # the same length as a live request: only the generation tells them apart
            n = self.e.live[0].seq_len
        self.save_all()
        try:
            req = self.e.add_request(n)
        except SparseRefError:
            self.check_untouched()
            return
        self.graph = None
        self.check_untouched(except_rids=(req.rid,))

    @precondition(lambda self: self.e.live)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.e.live))
        self.stale = self.last  # the last step's batch goes stale with this finish
        self.save_all()
        self.e.finish(req)
        self.graph = None
        self.check_untouched()

    @precondition(lambda self: self.e.live)
    @rule(by_hand=st.booleans())
    def step(self, by_hand):
        """``engine.step()``, or its two halves by hand (the batch is kept: a later finish makes it stale)."""
        self.save_all()
        try:
            if by_hand:
                batch = decode_step(self.e.manager, self.e.live)
                inputs = [self.e.decode_inputs(layer) for layer in range(2)]
                self.e.forward(batch, inputs)
                self.last = (batch, inputs)
            else:
                self.e.step()
        except SparseRefError:  # refused (out of room): nothing changed
            self.check_untouched()
            return
        self.check_prefix_kept()

    @precondition(lambda self: self.stale is not None and self.e.live)
    @rule()
    def forward_a_stale_batch(self):
        batch, inputs = self.stale
        self.stale = None
        self.save_all()
        try:
            self.e.forward(batch, inputs)
            raise AssertionError("a batch built before a request left must be refused")
        except SparseRefError:
            pass
        self.check_untouched()

    @precondition(lambda self: self.e.live)
    @rule(data=st.data())
    def grow_outside_the_engine(self, data):
        req = data.draw(st.sampled_from(self.e.live))
        self.save_all()
        try:
            self.e.manager.grow(req, 1)
        except SparseRefError:
            return
        self.graph = None
        self.check_untouched(except_rids=(req.rid,))
        self.save_all()
        try:
            self.e.step()
            raise AssertionError("a step over a request grown outside the engine must be refused")
        except SparseRefError:
            self.check_untouched()
        self.e.finish(req)  # the way out: finish the changed request

    @precondition(lambda self: self.e.live)
    @rule(data=st.data())
    def free_a_live_requests_page_or_row(self, data):
        req = data.draw(st.sampled_from(self.e.live))
        self.save_all()
        m = self.e.manager
        for call in (lambda: m.allocator.free(req.pages[-1:]), lambda: m.req_to_token_pool.free([req.req_pool_idx])):
            try:
                call()
                raise AssertionError("a live request's page or row must not be freed")
            except SparseRefError:
                pass
        self.check_untouched()

    @precondition(lambda self: self.e.live)
    @rule(replays=st.integers(0, 2))
    def graph_step(self, replays):
        if self.graph is None or [r.rid for r in self.e.live] != self.graph.rids:
            self.graph = GraphedDecodeStep(self.e)
        self.save_all()
        try:
            self.graph.step()
        except SparseRefError:
            self.check_untouched()
            self.graph = None
            return
        self.check_prefix_kept()
        for _ in range(replays):  # the same step again: the same token's K/V and bounds, nothing else
            self.save_all()
            self.graph.replay()
            self.check_untouched()

    @invariant()
    def pools_are_consistent(self):
        m = self.e.manager
        if not hasattr(self, "e"):
            return
        owned = [p for r in self.e.live for p in r.pages]
        assert len(owned) == len(set(owned)), "no page has two owners"
        assert m.allocator.available_pages() == m.allocator.num_pages - 1 - len(owned)
        assert set(self.e.written) == {r.rid for r in self.e.live}


EngineIsolation.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
TestEngineIsolation = EngineIsolation.TestCase
