"""KV offload with a per-request device hot buffer (``sparse_ref.offload``, ``DecodeEngine(offload_buffer=...)``).

The offload engine must equal the all-on-device engine exactly: the same selections, the same attention
inputs (the K/V attention reads, token by token) and the same outputs, at every step of a script where
requests join and leave (rows and pages reused). The hot buffer itself: least-recently-used replacement,
the newest token always resident, a wholesale change of selection, a row forgotten when its request leaves,
every held slot equal to the host pool's copy.
"""

from __future__ import annotations

import pytest
import torch

import sparse_ref
from sparse_ref.backend import choose_backend
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.engine_graph import GraphedDecodeStep
from sparse_ref.errors import ConfigError, SparseRefError
from sparse_ref.offload import HostKVPool, HotBuffer, OffloadedKV, check_offload_backend, positions_read
from sparse_ref.workloads import PlantedEngineWorkload

DEVICE = sparse_ref.default_device()

INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)
LAYERS = ["quest", "deepseek_dsa", None]
P = 4
SCRIPT = [("add", 37), ("add", 22), ("step",), ("step",), ("add", 9), ("step",), ("finish", 0), ("step",),
          ("add", 41), ("step",), ("step",), ("finish", 1), ("add", 30), ("step",), ("step",), ("step",)]


def engines(offload_buffer=64, backend="torch", device="cpu", dtype=torch.float32):
    wl = PlantedEngineWorkload(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=13)
    cfg = SparseConfig(page_budget=2, num_recent_pages=1, num_sink_pages=1, min_sparse_seq_len=12)
    kw = dict(dsa_topk=8, page_size=P, max_requests=3, max_context_len=64, backend=backend,
              device=device, dtype=dtype)
    return DecodeEngine(wl, LAYERS, cfg, **kw), DecodeEngine(wl, LAYERS, cfg, offload_buffer=offload_buffer, **kw)


def gathered(engine, trace, md, buffers):
    """The K/V attention reads per row (tokens in table order, up to kv_len): [bs] lists of [n, H, D] pairs."""
    k_buf, v_buf = buffers
    out = []
    for r in range(md.page_table.shape[0]):
        n = int(md.kv_lens[r])
        offsets = torch.arange(md.page_size, device=md.page_table.device)
        slots = (md.page_table[r].long()[:, None] * md.page_size + offsets).reshape(-1)[:n]
        out.append((k_buf[slots], v_buf[slots]))
    return out


def assert_hot_matches_host(e):
    """Every slot the hot buffer holds a token in has exactly that token's K/V of the host pool."""
    hot, r2t = e.offload.hot, e.manager.req_to_token_pool.req_to_token
    for layer in e.offload.layers:
        for req in e.live:
            tokens = hot.token[layer, req.req_pool_idx]
            held = (tokens >= 0).nonzero().squeeze(1)
            if held.numel() == 0:
                continue
            slots = hot.base(req.req_pool_idx) + held
            src = r2t[req.req_pool_idx, tokens[held]].long().cpu()
            assert torch.equal(hot.k[layer][slots].cpu(), e.offload.host.k[layer][src])
            assert torch.equal(hot.v[layer][slots].cpu(), e.offload.host.v[layer][src])


def run(script, pair):
    base, off = pair
    steps = 0
    for op in script:
        if op[0] == "add":
            for e in pair:
                e.add_request(op[1])
        elif op[0] == "finish":
            for e in pair:
                e.finish(e.live[op[1]])
        else:
            a, b = base.step(), off.step()
            steps += 1
            pool = base.manager.token_to_kv_pool
            for ta, tb in zip(a.layers, b.layers, strict=True):
                assert torch.equal(ta.out, tb.out), (steps, ta.layer)  # the same outputs, bit for bit
                if tb.offload is None:
                    continue
                assert torch.equal(ta.metadata.selected, tb.metadata.selected)
                want = gathered(base, ta, ta.metadata, (pool.get_key_buffer(ta.layer), pool.get_value_buffer(ta.layer)))
                got = gathered(off, tb, tb.offload, (off.offload.hot.k[tb.layer], off.offload.hot.v[tb.layer]))
                for (ka, va), (kb, vb) in zip(want, got, strict=True):
                    assert torch.equal(ka, kb) and torch.equal(va, vb), (steps, ta.layer)
            assert_hot_matches_host(off)
    return steps


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_offload_engine_equals_the_all_on_device_engine_through_joins_and_leaves(backend):
    """torch: the reference swap-in; triton: the swap-in kernel (one launch per layer, no host sync)."""
    pair = engines(backend=backend, device=DEVICE if backend == "triton" else "cpu")
    assert run(SCRIPT, pair) == 9
    hot = pair[1].offload.hot
    assert hot.hits > 0 and hot.misses > 0 and hot.bytes_in == hot.misses * 2 * 2 * 8 * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_16bit_offload_engine_stores_the_new_token_as_set_kv_does(dtype):
    """The new token's K/V reaches the hot buffer and the host pool rounded by torch, as ``set_kv`` stores it on the
    all-on-device engine (the kernel once stored fp32 into bf16 itself: the interpreter truncates where torch rounds
    to nearest, and the outputs drifted from step 1); so the offload engine equals it bit for bit."""
    pair = engines(backend="triton", device=DEVICE, dtype=dtype)
    assert run(SCRIPT, pair) == 9 and pair[1].offload.hot.k[0].dtype == dtype


def test_the_kernel_with_the_smallest_buffer_spans_only_what_a_row_reads():
    """A 16-slot buffer under a 64-token-wide Quest table: each kernel program lists only its first 17 table
    entries (no row reads more), yet the table attention reads keeps the device table's width, zeros past
    the row's tokens, and the engine still equals the all-on-device one."""
    base, off = pair = engines(offload_buffer=16, backend="triton", device=DEVICE)
    assert run(SCRIPT, pair) == 9 and off.offload.hot.misses > 0
    a, b = base.step(), off.step()  # one more step, on the script's live requests
    md, hot_md = b.layers[0].metadata, b.layers[0].offload
    assert hot_md.page_table.shape[1] == md.page_table.shape[1] * P > off.offload.hot.size + 1
    assert int(hot_md.kv_lens.max()) <= off.offload.hot.size + 1
    assert bool((hot_md.page_table[:, off.offload.hot.size + 1:] == 0).all())
    assert torch.equal(a.layers[0].out, b.layers[0].out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_offload_engine_equals_the_all_on_device_engine():
    """On a GPU: K/V of the sparse layers only in pinned host memory, read by the kernels through unified
    addressing (the swap-in, the Quest bounds); equal to the all-on-device engine at every step."""
    pair = engines(backend="triton", device="cuda")
    assert all(pair[1].manager.token_to_kv_pool.k_buffer[layer].is_pinned() for layer in pair[1].offload.layers)
    assert run(SCRIPT, pair) == 9 and pair[1].offload.hot.misses > 0


def test_offloaded_layers_keep_their_kv_in_host_memory_only():
    """The KV pool's offloaded layers are the host pool (no second copy); a dense layer stays on the device; a
    GPU engine with the torch reference is refused (it would index host tensors with device indices)."""
    _, off = engines()
    pool = off.manager.token_to_kv_pool
    assert pool.host_layers == {0, 1} and off.offload.layers == [0, 1]
    assert all(pool.k_buffer[i] is off.offload.host.k[i] and pool.v_buffer[i] is off.offload.host.v[i] for i in (0, 1))
    assert off.offload.host.k[2] is None and pool.k_buffer[2].device == off.device
    assert off.offload.hot.k[2] is None and off.offload.hot.k[0] is not None  # hot slots only for the offloaded layers
    with pytest.raises(ConfigError, match="backend: expected 'triton'"):
        check_offload_backend([0], choose_backend("torch", "cuda"))
    check_offload_backend([], choose_backend("torch", "cuda"))  # no offload: any backend


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the reference runs on CPU; on a GPU the selections may round apart")
def test_the_kernel_and_the_reference_leave_the_same_hot_buffer_state():
    """The same script through the reference and through the kernel: every slot, table and count identical."""
    ref, kern = engines(backend="torch")[1], engines(backend="triton", device=DEVICE)[1]
    for op in SCRIPT:
        for e in (ref, kern):
            if op[0] == "add":
                e.add_request(op[1])
            elif op[0] == "finish":
                e.finish(e.live[op[1]])
        if op[0] == "step":
            a, b = ref.step(), kern.step()
            assert all(torch.equal(x.offload.page_table, y.offload.page_table) for x, y in
                       zip(a.layers, b.layers, strict=True) if x.offload is not None)
            assert (a.offload_hits, a.offload_misses) == (b.offload_hits, b.offload_misses)
        for name in ("token", "last_used", "slot_of", "clock", "stats"):
            assert torch.equal(getattr(ref.offload.hot, name), getattr(kern.offload.hot, name).cpu()), (op, name)
        for layer in ref.offload.layers:
            assert torch.equal(ref.offload.hot.k[layer], kern.offload.hot.k[layer].cpu())
            assert torch.equal(ref.offload.host.v[layer], kern.offload.host.v[layer])


def test_a_buffer_smaller_than_what_a_step_reads_is_refused_before_anything_is_built():
    # Quest reads at most (1 sink + 2 + 1 recent) pages x 4 tokens = 16; DSA its top 8; a row below
    # min_sparse_seq_len (12) reads all its 11 tokens: 16 token slots
    with pytest.raises(ConfigError, match=r"offload_buffer: expected at least 16 token slots"):
        engines(offload_buffer=15)
    assert engines(offload_buffer=16)[1].offload.hot.size == 16
    with pytest.raises(ConfigError, match="offload_buffer"):
        engines(offload_buffer=0)
    pair = engines(offload_buffer=16)  # the smallest buffer still equals the all-on-device engine
    assert run(SCRIPT, pair) == 9 and pair[1].offload.hot.misses > 0


def test_the_buffer_holds_a_dsa_layers_top_k_and_no_more_than_the_context():
    """A DSA layer reads its top-k (24 here, past Quest's 16 and the short rows' 11): a smaller buffer is refused
    when the engine is built, not at its first step; no row reads more than the context before its newest token,
    so a buffer of max_context_len - 1 slots is enough whatever the selection."""
    wl = PlantedEngineWorkload(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=13)
    cfg = SparseConfig(page_budget=2, num_recent_pages=1, num_sink_pages=1, min_sparse_seq_len=12)
    kw = dict(dsa_topk=24, page_size=P, max_requests=2, max_context_len=64, backend="torch")
    with pytest.raises(ConfigError, match=r"offload_buffer: expected at least 24 token slots"):
        DecodeEngine(wl, ["deepseek_dsa", None], cfg, offload_buffer=23, **kw)
    e = DecodeEngine(wl, ["deepseek_dsa", None], cfg, offload_buffer=24, **kw)
    e.add_request(40)
    e.step()  # 24 of 41 tokens read, in 24 slots
    short = {**kw, "max_context_len": 20}
    with pytest.raises(ConfigError, match=r"offload_buffer: expected at least 19 token slots"):
        DecodeEngine(wl, ["deepseek_dsa", None], cfg, offload_buffer=18, **short)
    e = DecodeEngine(wl, ["deepseek_dsa", None], cfg, offload_buffer=19, **short)
    e.add_request(19)
    assert e.step().layers[0].offload is not None  # the last step the context allows: 19 read besides the newest


def test_a_graphed_step_runs_the_offload_kernel_and_refuses_the_reference():
    _, off = engines()
    off.add_request(20)
    with pytest.raises(ConfigError, match="backend"):
        GraphedDecodeStep(off)
    base, off = engines(backend="triton", device=DEVICE)
    for e in (base, off):
        e.add_request(30)
        e.add_request(17)
    graphed = [GraphedDecodeStep(e) for e in (base, off)]  # on CPU it runs eagerly, on the same static tensors
    for _ in range(3):
        a, b = (g.step() for g in graphed)
        assert all(torch.equal(x.out, y.out) for x, y in zip(a, b, strict=True))
    assert off.offload.hot.hits > 0


def test_a_finished_requests_row_starts_empty_for_the_next_request():
    base, off = engines()
    for e in (base, off):
        e.add_request(40)
        e.step()
        e.step()
    row = off.live[0].req_pool_idx
    assert bool((off.offload.hot.token[:, row] >= 0).any())
    for e in (base, off):
        e.finish(e.live[0])
    assert bool((off.offload.hot.token[:, row] == -1).all())
    misses = off.offload.hot.misses
    for e in (base, off):
        e.add_request(40)  # same row, same length, reused pages: nothing stale may be read
    a, b = base.step(), off.step()
    assert all(torch.equal(x.out, y.out) for x, y in zip(a.layers, b.layers, strict=True))
    assert off.offload.hot.misses > misses  # everything it read came in from the host


# ---------------------------------------------------------------- the hot buffer alone
def buffer(size=4, rows=2, tokens=32):
    host = HostKVPool(1 + rows * tokens, 1, 1, 2)
    host.k[0].copy_(torch.randn_like(host.k[0]))
    host.v[0].copy_(torch.randn_like(host.v[0]))
    r2t = torch.arange(1, 1 + rows * tokens, dtype=torch.int32).view(rows, tokens)  # row r token t: slot 1 + r*T + t
    return HotBuffer(1, rows, size, 1, 2, tokens), host, r2t


def read(hot, host, r2t, row, want, seq_len, width=8):
    positions = torch.zeros(1, width, dtype=torch.int32)
    positions[0, : len(want)] = torch.tensor(want)
    table = hot.swap_in(0, torch.tensor([row]), positions, torch.tensor([len(want)]), torch.tensor([seq_len]), host,
                        r2t)
    slots = table[0, : len(want)].long()
    return slots, hot.k[0][slots]


def test_least_recently_used_slots_are_replaced_and_the_newest_token_is_resident():
    hot, host, r2t = buffer(size=4)
    hot.write_newest(0, torch.tensor([0]), host.k[0][r2t[0, 9].long()][None], host.v[0][r2t[0, 9].long()][None])
    slots, k = read(hot, host, r2t, 0, [0, 1, 2, 3, 9], seq_len=10)  # 4 misses, the newest (9) a hit
    assert torch.equal(k, host.k[0][r2t[0, [0, 1, 2, 3, 9]].long()])
    assert (hot.hits, hot.misses) == (1, 4) and int(slots[-1]) == hot.base(0) + hot.size
    read(hot, host, r2t, 0, [0, 1, 4], seq_len=10)  # 0, 1 hit; 4 takes the least recently used of 2, 3
    assert sorted(hot.token[0, 0].tolist()) == [0, 1, 3, 4] or sorted(hot.token[0, 0].tolist()) == [0, 1, 2, 4]
    read(hot, host, r2t, 0, [3, 5], seq_len=10)  # 3 (if held) hits; 5 evicts the oldest: 2 or 3, never 0, 1, 4
    held = set(hot.token[0, 0].tolist())
    assert {0, 1, 4} - held and 5 in held and 3 in held  # 0 and 1 were used two steps ago: one of them goes


def test_a_selection_that_changes_wholesale_misses_everything_and_reads_the_right_rows():
    hot, host, r2t = buffer(size=4, rows=2)
    read(hot, host, r2t, 1, [0, 1, 2, 3], seq_len=20)
    misses = hot.misses
    slots, k = read(hot, host, r2t, 1, [10, 11, 12, 13], seq_len=20)  # a topic switch: nothing kept is read
    assert hot.misses - misses == 4
    assert torch.equal(k, host.k[0][r2t[1, [10, 11, 12, 13]].long()])
    assert set(hot.token[0, 0].tolist()) == {-1}, "another row's buffer is untouched"


def test_many_rows_evict_only_their_own_slots():
    hot, host, r2t = buffer(size=3, rows=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        for row in (0, 1):
            want = sorted(torch.randperm(20, generator=g)[:3].tolist())
            _, k = read(hot, host, r2t, row, want, seq_len=25)
            assert torch.equal(k, host.k[0][r2t[row, want].long()])
        assert all(s // hot.width == 0 for s in (hot.token[0, 0] >= 0).nonzero().squeeze(1).tolist())


def test_positions_read_follow_the_all_on_device_table():
    selected = torch.tensor([[0, 2, 4, -1], [1, 3, -1, -1], [0, -1, -1, -1]])
    positions, counts = positions_read(selected, torch.tensor([3, 2, 0]), torch.tensor([True, True, False]),
                                       torch.tensor([18, 15, 3]), 4, 12)
    assert counts.tolist() == [10, 7, 3] and positions.dtype == torch.int32 and positions.shape == (3, 12)
    assert positions.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 0, 0], [4, 5, 6, 7, 12, 13, 14, 0, 0, 0, 0, 0],
                                  [0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]]


def test_each_step_reports_its_hits_and_misses():
    """A steady request reuses most of what it read the step before (the hit rate offload lives on), and the
    counts add up to the tokens its sparse layers read."""
    _, off = engines()
    off.add_request(44)
    first = off.step()
    assert first.offload_misses > 0
    later = [off.step() for _ in range(4)]
    for r in later:
        read = sum(int(t.offload.kv_lens.sum()) for t in r.layers if t.offload is not None)
        assert r.offload_hits + r.offload_misses == read
    assert sum(r.offload_hits for r in later) > sum(r.offload_misses for r in later)


def test_a_drifting_query_turns_away_from_the_steady_one():
    """``query_drift``: the first decode query equals the steady workload's; later ones turn (cosine falls with
    the steps), and an angle outside [0, pi] is refused."""
    steady = PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, query_noise=0.0)
    drift = PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, query_noise=0.0,
                                  query_drift=0.1)
    req = steady.request(0, 20)
    q0 = [w.decode(req, 0, 20, with_hidden=False)[0] for w in (steady, drift)]
    assert torch.equal(q0[0], q0[1])
    cos = [torch.nn.functional.cosine_similarity(steady.decode(req, 0, 20 + t, False)[0],
                                                 drift.decode(req, 0, 20 + t, False)[0], dim=-1).mean()
           for t in (5, 10, 15)]
    assert 1 > cos[0] > cos[1] > cos[2]
    with pytest.raises(SparseRefError, match="query_drift"):
        PlantedEngineWorkload(query_drift=-0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphed_offload_step_equals_the_eager_one():
    """On a GPU the offload step (swap-in kernel included) is captured in one CUDA graph; its replays give the
    outputs of the eager offload engine, step after step (the capture runs the first step twice: all hits)."""
    (_, eager), (_, graphed) = engines(backend="triton", device="cuda"), engines(backend="triton", device="cuda")
    for e in (eager, graphed):
        e.add_request(30)
        e.add_request(45)
    step = GraphedDecodeStep(graphed)
    for _ in range(4):
        a, b = eager.step(), step.step()
        assert all(torch.equal(x.out, y.out) for x, y in zip(a.layers, b, strict=True))
    assert step.graph is not None and graphed.offload.hot.hits > 0


# ---------------------------------------------------------------- every limit checked when it can first be known
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("size", [70000, 2**31, 65537])
def test_a_buffer_past_the_kernels_limit_is_refused_when_the_engine_is_built(backend, size):
    """``offload_buffer=70000`` once built an engine whose first step the launcher refused after the request had
    grown (stuck from then on); the limit is known at construction, so it is refused there."""
    with pytest.raises(ConfigError, match=r"offload_buffer: expected an int in \[1, 65536\]"):
        engines(offload_buffer=size, backend=backend)
    base, off = engines(offload_buffer=1 << 16, backend=backend)  # the largest allowed: built, and it steps
    assert off.offload.hot.size == 1 << 16


@pytest.mark.parametrize("bad", ["abc", -5, 0, 2.0, True])
def test_an_offload_buffer_is_checked_even_when_every_layer_is_dense(bad):
    wl = PlantedEngineWorkload(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, seed=1)
    with pytest.raises(ConfigError, match="offload_buffer"):
        DecodeEngine(wl, [None, None], offload_buffer=bad)
    assert DecodeEngine(wl, [None, None], offload_buffer=16).offload is None  # nothing to offload: allowed


def pool():
    from sparse_ref.memory import TokenToKVPool

    return TokenToKVPool(8, P, 1, 1, 2, torch.float32, "cpu", host_layers=[0])


def test_the_offload_classes_refuse_bad_sizes_and_rows():
    for make, name in ((lambda: HostKVPool(-1, 1, 1, 2), "num_slots"),
                       (lambda: HostKVPool(9, 0, 1, 2), "num_layers"),
                       (lambda: HotBuffer(1, 2, -1, 1, 2, 16), "size"),
                       (lambda: HotBuffer(1, 2, 70000, 1, 2, 16), "size"),
                       (lambda: HotBuffer(1, 0, 4, 1, 2, 16), "num_rows"),
                       (lambda: HotBuffer(1, 2, 4, 1, 2, 0), "max_context_len"),
                       (lambda: HotBuffer(2, 2, 4, 1, 2, 16, layers=[2]), "layers"),
                       (lambda: HotBuffer(2, 2, 4, 1, 2, 16, layers=[-1]), "layers"),  # (would wrap to the last)
                       (lambda: HotBuffer(2, 2, 4, 1, 2, 16, layers=[1, 1]), "layers"),
                       (lambda: HotBuffer(1, 2, 4, 1, 2, 16, dtype="float16"), "dtype"),
                       (lambda: HostKVPool(9, 1, 1, 2, dtype=torch.int32), "dtype"),
                       (lambda: OffloadedKV(pool(), [0], 2, 4, 16, "triton", "cpu"), "backend")):
        with pytest.raises(ConfigError, match=name):
            make()
    assert OffloadedKV(pool(), [0], 2, 4, 16, choose_backend("torch", "cpu"), "cpu").hot.k[0].shape == (11, 1, 2)
    hot = HotBuffer(1, 3, 4, 1, 2, 16)
    hot.token[0, 2] = 5  # the last row holds a token: forget(-1) once emptied it (another request's row)
    for row in (-1, 3, "0", 1.0):
        with pytest.raises(SparseRefError, match="forget"):
            hot.forget(row)
    assert int(hot.token[0, 2, 0]) == 5
    hot.forget(2)
    assert bool((hot.token[0, 2] == -1).all())
