"""Random request lifecycles with Quest and DSA attached the plain SGLang way, and no opt-in.

A hypothesis state machine admits, extends (chunked prefill), decodes and releases requests on
one ``KVCacheManager``, so freed pages are handed to new requests all the time. Each algorithm
is attached only through its SGLang-shaped constructor:

* Quest: ``initialize_representation_pool(start, end, token_to_kv_pool, req_to_token_pool)``;
* DSA: ``IndexerKeyCache.from_pools(token_to_kv_pool, req_to_token_pool, config)``,
  ``LightningIndexer(...).attach_cache(cache)``, ``DSAAlgorithm.initialize_representation_pool(...)``.

After every step: no selection and no score involves a page its request does not own.

* Quest: a page with valid bounds is a complete page of a live request, and its bounds are the
  min/max of the keys that request wrote there (never a previous owner's); every selection
  names only pages of its own request.
* DSA: the indexer scores a request only when every key of its history was written by that
  request; a history that was never indexed (its slots may hold a previous owner's keys) must
  be refused, and selections name only positions of the request's own tokens.
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_ref import BatchError, KVCacheManager, PoolError, build_decode_batch, build_extend_batch, decode_step
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.algorithms.dsa import DSAAlgorithm, LightningIndexer
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.memory import IndexerKeyCache

P, H_KV, D = 2, 1, 4
MAX_LEN, NUM_PAGES, MAX_REQS = 16, 12, 3
STEPS = settings(max_examples=50, stateful_step_count=20, deadline=None)


def new_manager():
    return KVCacheManager.create(max_requests=MAX_REQS, max_context_len=MAX_LEN, num_pages=NUM_PAGES, page_size=P,
                                 num_kv_heads=H_KV, head_dim=D)


class Lifecycle(RuleBasedStateMachine):
    """Admit / extend / decode / release; subclasses attach an algorithm and say what each step means to it."""

    @initialize()
    def start(self):
        self.m = new_manager()
        self.live = []
        self.gen = torch.Generator().manual_seed(0)
        self.attach()

    def write_keys(self, req, start):
        """Random K (and V) for tokens [start, seq_len) of req, as a model layer would write them."""
        slots = self.m.req_to_token_pool.req_to_token[req.req_pool_idx, start:req.seq_len].long()
        k = torch.randn(slots.shape[0], H_KV, D, generator=self.gen)
        self.m.token_to_kv_pool.set_kv(0, slots, k, k)

    @rule(n=st.integers(1, 7), index=st.booleans())
    def admit(self, n, index):
        try:
            r = self.m.admit(n)
        except PoolError:
            return
        self.write_keys(r, 0)
        self.live.append(r)
        self.prefilled(r, 0, index)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 5))
    def extend(self, i, n):
        r = self.live[i % len(self.live)]
        old = r.seq_len
        try:
            self.m.grow(r, n)
        except PoolError:
            return
        self.write_keys(r, old)
        self.prefilled(r, old, True)

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3, unique=True))
    def decode(self, picks):
        reqs = list({id(r): r for r in (self.live[i % len(self.live)] for i in picks)}.values())
        try:
            fb = decode_step(self.m, reqs)
        except PoolError:
            return
        for r in reqs:
            self.write_keys(r, r.seq_len - 1)
        self.decoded(reqs, fb)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        self.m.release(self.live.pop(i % len(self.live)))
        self.released()

    def released(self):
        pass


# ----------------------------------------------------------------------------- Quest
class QuestLifecycle(Lifecycle):
    def attach(self):
        self.algo = QuestAlgorithm(SparseConfig(page_budget=1, num_recent_pages=1))
        self.algo.initialize_representation_pool(0, 1, self.m.token_to_kv_pool, self.m.req_to_token_pool)

    def prefilled(self, req, prefix, index):
        fb = build_extend_batch(self.m, [req], [prefix])
        self.algo.construct_representations(0, fb, self.m.token_to_kv_pool.get_key_buffer(0))

    def decoded(self, reqs, fb):
        self.algo.update_representations(0, fb, self.m.token_to_kv_pool.get_key_buffer(0))

    @invariant()
    def valid_bounds_are_the_owners_own(self):
        if not hasattr(self, "algo"):
            return
        owner = {p: (r, j) for r in self.live for j, p in enumerate(r.pages)}
        keys = self.m.token_to_kv_pool.get_key_buffer(0)
        valid = self.algo.page_valid[0]
        for p in valid.nonzero().squeeze(1).tolist():
            assert p in owner, f"page {p} has bounds but no live owner (freed, or never allocated)"
            r, j = owner[p]
            assert (j + 1) * P <= r.seq_len, f"page {p} (logical {j} of a {r.seq_len}-token request) is not complete"
            page_keys = keys[p * P:(p + 1) * P].float()
            assert torch.equal(self.algo.page_min[0][p], page_keys.amin(0)), f"page {p}: bounds of other keys"
            assert torch.equal(self.algo.page_max[0][p], page_keys.amax(0)), f"page {p}: bounds of other keys"

    @invariant()
    def selections_name_only_own_pages(self):
        if not getattr(self, "live", None):
            return
        fb = build_decode_batch(self.m, self.live)
        q = torch.randn(len(self.live), H_KV, D, generator=self.gen)
        mask = torch.ones(len(self.live), dtype=torch.bool)
        for retrieve in (self.algo.retrieve_topk, self.algo.retrieve_topk_loop):
            sel, lens = retrieve(q, 0, fb.req_pool_indices, mask, forward_batch=fb)
            for r, row, k in zip(self.live, sel.tolist(), lens.tolist(), strict=True):
                assert all(0 <= j < len(r.pages) for j in row[:k]) and all(j == -1 for j in row[k:])
        scores = self.algo.score_pages(q, 0, fb.req_pool_indices, fb)
        for r, row in zip(self.live, scores, strict=True):
            n_complete = r.seq_len // P
            assert torch.isneginf(row[n_complete:len(r.pages)]).all(), "an incomplete page has a score"


QuestLifecycle.TestCase.settings = STEPS
TestQuestLifecycle = QuestLifecycle.TestCase


# ----------------------------------------------------------------------------- DSA
CFG = IndexerConfig(hidden_size=16, q_lora_rank=8, n_heads=2, head_dim=16, rope_dim=4, index_topk=3)


class DSALifecycle(Lifecycle):
    def attach(self):
        pool = self.m.token_to_kv_pool
        cache = IndexerKeyCache.from_pools(pool, self.m.req_to_token_pool, CFG)
        self.indexer = LightningIndexer(CFG, seed=1).attach_cache(cache)
        self.algo = DSAAlgorithm()
        self.algo.initialize_representation_pool(0, 1, pool, self.m.req_to_token_pool)
        self.indexed = {}  # rid -> every token of the request so far had its key written by the request itself

    def run_indexer(self, reqs, fb):
        """DSA retrieval for ``fb``; refused exactly when some request's history was not indexed by itself."""
        T = fb.positions.shape[0]
        x = torch.randn(T, CFG.hidden_size, generator=self.gen)
        q_lora = torch.randn(T, CFG.q_lora_rank, generator=self.gen)
        mask = torch.ones(len(reqs), dtype=torch.bool)
        prefix = fb.extend_prefix_lens.tolist() if fb.extend_prefix_lens is not None else [r.seq_len - 1 for r in reqs]
        history_ok = all(self.indexed[r.rid] or p == 0 for r, p in zip(reqs, prefix, strict=True))
        try:
            sel, _ = self.algo.retrieve_topk(None, 0, fb.req_pool_indices, mask, indexer=self.indexer,
                                             forward_batch=fb, x=x, q_lora=q_lora, positions=fb.positions)
        except BatchError:
            assert not history_ok, "a request whose whole history it indexed itself was refused"
            for r in reqs:
                self.indexed[r.rid] = False
            return
        assert history_ok, "scored a history the request never indexed: its slots held a previous owner's keys"
        pos = fb.positions.tolist()
        for t, row in enumerate(sel.tolist()):
            assert all(-1 <= s <= pos[t] for s in row), "a token selected a position past its own"
        for r in reqs:
            self.indexed[r.rid] = True

    def prefilled(self, req, prefix, index):
        self.indexed.setdefault(req.rid, False)
        if index:
            self.run_indexer([req], build_extend_batch(self.m, [req], [prefix]))
        else:
            self.indexed[req.rid] = False  # a prompt that skipped the indexer: its history has no keys of its own

    def decoded(self, reqs, fb):
        self.run_indexer(reqs, fb)


DSALifecycle.TestCase.settings = STEPS
TestDSALifecycle = DSALifecycle.TestCase

