"""The Triton paged decode attention kernel == the torch references, on awkward shapes; its edge cases and checks.

On CPU the kernel runs through Triton's interpreter (tiny sizes). Tolerances: the package's one policy
(``sparse_ref.metrics.assert_matches_reference``): fp32 K/V ``"fp32"`` (the kernel accumulates in fp32
like the reference); 16-bit K/V ``"attention_16bit"`` (the reference reads the same 16-bit data widened
to fp32; under the interpreter the kernel does the same, 1e-5; compiled on a GPU its two-term 16-bit
dots keep ~16 mantissa bits, 1e-3).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ref
from sparse_ref import SparseConfig
from sparse_ref.adaptor import to_attention_metadata
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.attention import dense_decode_attention, sparse_decode_attention
from sparse_ref.bench.timing import capture_graph
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import decode_attention as da
from sparse_ref.kernels import tuning
from sparse_ref.kernels.decode_attention import MAX_SPLITS, choose_num_splits, paged_decode_attention
from sparse_ref.metrics import assert_matches_reference
from sparse_ref.workloads import make_planted_workload

DEVICE = sparse_ref.default_device()




def make_case(lens, num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype=torch.float32, q_dtype=torch.float32,
              width=None, num_pages=12, seed=0):
    """Random q, K/V pools and a page table whose used entries name random pages (the pool's last page included)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(lens)
    width = width or max(1, max(-(-n // page_size) for n in lens))
    q = torch.randn(bs, num_q_heads, head_dim, generator=gen).to(q_dtype)
    k = (torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen) * 2).to(kv_dtype)
    v = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    table = torch.zeros(bs, width, dtype=torch.int32)  # padding entries: page 0, as the adaptor writes
    for r, n in enumerate(lens):
        used = -(-n // page_size)
        table[r, :used] = torch.randint(0, num_pages, (used,), generator=gen, dtype=torch.int32)
    if bs and width:
        table[0, 0] = num_pages - 1  # the pool's last page
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, table, kv_lens)]


def check_against_reference(case, page_size, scale=None, **knobs):
    """The kernel (with launch ``knobs`` set in its TUNING table) against the torch reference."""
    q, k, v, table, kv_lens = case
    with tuning(da.TUNING, **knobs):
        got = paged_decode_attention(q, k, v, table, kv_lens, page_size, scale=scale)
    want = sparse_decode_attention(q, k, v, table, kv_lens, page_size, scale=scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert_matches_reference(got, want, "fp32" if k.dtype == torch.float32 else "attention_16bit")
    return got


@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 1), (8, 2)])  # GQA ratios 1 (MHA), 4, 8, 4
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_awkward_lengths_gqa_ratios_and_dtypes(heads, kv_dtype):
    """Lengths 0, 1, one page, not a multiple of the page size, the full table; splits 1, 3 and many."""
    page_size = 4
    case = make_case([0, 1, 4, 7, 13], *heads, 12, page_size, kv_dtype, width=4,
                     seed=heads[0] * 10 + heads[1])
    for num_splits in (None, 1, 3, 7):  # (one split: no merge launch)
        got = check_against_reference(case, page_size, num_splits=num_splits)
        assert not got[0].any()  # kv_len 0: zeros


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_16bit_queries_and_a_custom_scale(q_dtype):
    case = make_case([5, 9], 4, 2, 16, 3, torch.bfloat16, q_dtype=q_dtype, seed=3)
    check_against_reference(case, 3, scale=0.3)


def test_more_splits_than_blocks_and_page_size_one():
    case = make_case([1, 5, 2], 2, 1, 8, 1, seed=4, num_pages=9)  # page size 1: token selections (DSA)
    check_against_reference(case, 1, num_splits=7)


@pytest.mark.knobs
@pytest.mark.parametrize("knobs", [dict(use_dot=False), dict(use_dot=True), dict(block_n=16), dict(block_n=64),
                                   dict(num_warps=2, precise=False)])
def test_launch_knobs_do_not_change_the_result(knobs):
    check_against_reference(make_case([11, 30], 4, 1, 8, 4, seed=5, width=9), 4, num_splits=2, **knobs)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=3), st.sampled_from([1, 3, 8]),
       st.sampled_from([(1, 1), (3, 3), (4, 1), (8, 1), (6, 2)]), st.sampled_from([4, 9, 16]),
       st.sampled_from([None, 1, 2, 5]), st.integers(0, 1000))
def test_random_shapes(lens, page_size, heads, head_dim, num_splits, seed):
    case = make_case(lens, *heads, head_dim, page_size, seed=seed, num_pages=20)
    check_against_reference(case, page_size, num_splits=num_splits)


def test_empty_rows_give_zeros_and_nan_queries_give_nan():
    """The expected semantics, stated directly: only a row with nothing to read gives 0; NaN propagates, through the
    merge of several splits as through one split (no merge)."""
    q, k, v, table, kv_lens = make_case([6, 0, 6, 0], 4, 2, 8, 4, seed=6)
    q[2, 1, 3] = float("nan")  # one NaN component: every logit of query head 1 is NaN
    q[3] = float("nan")  # an empty row: nothing is read, so 0 even for a NaN query
    with tuning(da.TUNING, num_splits=1):
        one = paged_decode_attention(q, k, v, table, kv_lens, 4)
    with tuning(da.TUNING, num_splits=2):
        out = paged_decode_attention(q, k, v, table, kv_lens, 4)
    assert torch.equal(out.isnan(), one.isnan())
    torch.testing.assert_close(out.nan_to_num(), one.nan_to_num(), rtol=1e-5, atol=1e-5)
    assert not out[1].any() and not out[3].any()
    assert bool(torch.isnan(out[2, 1]).all())
    assert bool(torch.isfinite(out[2, [0, 2, 3]]).all()) and bool(torch.isfinite(out[0]).all())
    clean = q.clone()
    clean[2, 1] = 0.0
    want = sparse_decode_attention(clean, k, v, table, kv_lens, 4)
    keep = torch.ones(4, dtype=torch.bool)
    keep[1] = False
    torch.testing.assert_close(out[2][keep], want[2][keep], rtol=1e-5, atol=1e-5)


def test_one_split_writes_the_output_without_a_merge_launch(monkeypatch):
    """One split: the split kernel writes ``out`` itself and the merge kernel is not launched; more splits merge."""
    case = make_case([37, 5, 0], 8, 2, 16, 4, torch.bfloat16, seed=8, num_pages=16)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched")

    with tuning(da.TUNING, num_splits=3):
        merged = paged_decode_attention(*case, 4)
    monkeypatch.setattr(da, "_decode_merge_kernel", NoLaunch())
    got = check_against_reference(case, 4, num_splits=1)
    torch.testing.assert_close(got, merged, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="merge kernel was launched"):
        check_against_reference(case, 4, num_splits=3)


def test_dense_and_sparse_steps_through_the_adaptor():
    """Dense page table (all pages) == dense_decode_attention; Quest's selected pages == sparse_decode_attention."""
    P = 4
    wl = make_planted_workload([37, 9, 64], page_size=P, num_q_heads=4, num_kv_heads=2, head_dim=8, seed=5)
    fb = wl.forward_batch
    algo = QuestAlgorithm(SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1))
    wl.attach(algo)
    mask = torch.ones(3, dtype=torch.bool)
    sel, lens = algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, mask, forward_batch=fb)
    dense_meta = to_attention_metadata(sel, lens, torch.zeros(3, dtype=torch.bool), fb, wl.req_to_token, P)
    sparse_meta = to_attention_metadata(sel, lens, mask, fb, wl.req_to_token, P)
    assert int(lens.max()) > 0
    q, k, v = (t.to(DEVICE) for t in (wl.queries, wl.k_buffer, wl.v_buffer))
    dense = paged_decode_attention(q, k, v, dense_meta[0].to(DEVICE), dense_meta[1].to(DEVICE), P)
    want = dense_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, wl.req_to_token, fb.req_pool_indices,
                                  fb.seq_lens)
    torch.testing.assert_close(dense.cpu(), want, rtol=1e-5, atol=1e-5)
    sparse = paged_decode_attention(q, k, v, sparse_meta[0].to(DEVICE), sparse_meta[1].to(DEVICE), P)
    want = sparse_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, sparse_meta[0], sparse_meta[1], P)
    torch.testing.assert_close(sparse.cpu(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sparse.cpu(), dense.cpu())  # the selection really dropped pages


def test_out_buffer_and_empty_batch():
    q, k, v, table, kv_lens = make_case([5, 3], 2, 1, 8, 4, seed=7)
    out = torch.full(q.shape, 7.0, device=DEVICE)
    with tuning(da.TUNING, num_splits=2):
        got = paged_decode_attention(q, k, v, table, kv_lens, 4, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, sparse_decode_attention(q, k, v, table, kv_lens, 4), rtol=1e-5, atol=1e-5)
    empty = paged_decode_attention(q[:0], k, v, table[:0], kv_lens[:0], 4)
    assert empty.shape == (0, 2, 8)


def test_num_splits_is_chosen_from_shapes_only():
    cpu = torch.device("cpu")
    assert choose_num_splits(64, 8, 32768, 32, cpu) == 1
    assert choose_num_splits(1, 1, 32768, 32, cpu) == 4
    assert choose_num_splits(1, 1, 20, 32, cpu) == 1  # never more splits than blocks of the static bound
    assert choose_num_splits(1, 1, 0, 32, cpu) == 1
    assert 1 <= choose_num_splits(1, 1, 10**6, 16, cpu) <= MAX_SPLITS


def _args():
    return make_case([5, 3], 4, 2, 8, 4, seed=8, width=3)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][0]), "q: expected a 3-D tensor"),
    (lambda a: a.update(q=a["q"].double()), "q: expected dtype"),
    (lambda a: a.update(q=a["q"][:, :3]), "q: expected a multiple of the 2 KV heads"),
    (lambda a: a.update(q=a["q"][..., :4]), "q: expected head dim 8"),
    (lambda a: a.update(k_buffer=a["k_buffer"].int()), "k_buffer: expected dtype"),
    (lambda a: a.update(k_buffer=a["k_buffer"].transpose(1, 2).contiguous().transpose(1, 2)),
     "k_buffer: expected a contiguous tensor"),
    (lambda a: a.update(v_buffer=a["v_buffer"].half()), "v_buffer: expected dtype"),
    (lambda a: a.update(v_buffer=a["v_buffer"][:-4]), "v_buffer: expected shape"),
    (lambda a: a.update(k_buffer=a["k_buffer"][:-1], v_buffer=a["v_buffer"][:-1]),
     "k_buffer: expected a whole number"),
    (lambda a: a.update(page_table=a["page_table"].long()), "page_table: expected dtype torch.int32"),
    (lambda a: a.update(page_table=a["page_table"][:1]), "page_table: expected 2 rows"),
    (lambda a: a.update(page_table=a["page_table"] + 12), r"page_table: expected values in \[0, 11\]"),
    (lambda a: a.update(page_table=a["page_table"] - 1), r"page_table: expected values in \[0, 11\]"),
    (lambda a: a.update(kv_lens=a["kv_lens"] + 10), r"kv_lens: expected values in \[0, 12\]"),
    (lambda a: a.update(kv_lens=a["kv_lens"] - 6), r"kv_lens: expected values in \[0, 12\]"),
    (lambda a: a.update(kv_lens=a["kv_lens"].long()), "kv_lens: expected dtype torch.int32"),
    (lambda a: a.update(kv_lens=a["kv_lens"][:1]), "kv_lens: expected shape"),
    (lambda a: a.update(page_size=0), "page_size: expected an int in"),
    (lambda a: a.update(page_size=4.0), "page_size: expected an int"),
    (lambda a: a.update(num_splits=0), r"num_splits.\]: expected an int in"),
    (lambda a: a.update(num_splits=65), r"num_splits.\]: expected an int in \[1, 64\]"),
    (lambda a: a.update(block_n=24), r"block_n.\]: expected a power of two"),
    (lambda a: a.update(scale=float("nan")), "scale: expected a finite number"),
    (lambda a: a.update(out=torch.empty(2, 4, 7, device=DEVICE)), "out: expected shape"),
    (lambda a: a.update(out=torch.empty(2, 4, 8, device=DEVICE, dtype=torch.bfloat16)), "out: expected dtype"),
    (lambda a: a.update(ready=torch.ones(2, 2, dtype=torch.int32, device=DEVICE)), r"ready: expected a tuple"),
    (lambda a: a.update(ready=(torch.ones(1, 2, dtype=torch.int32, device=DEVICE), 4)), "ready flags: expected a row"),
    (lambda a: a.update(ready=(torch.ones(2, 0, dtype=torch.int32, device=DEVICE), 4)), "ready flags: expected a row"),
    (lambda a: a.update(ready=(torch.ones(2, 2, device=DEVICE), 4)), "ready flags: expected dtype torch.int32"),
    (lambda a: a.update(ready=(torch.ones(2, dtype=torch.int32, device=DEVICE), 4)), r"ready flags: expected shape"),
    (lambda a: a.update(ready=(torch.ones(2, 2, dtype=torch.int32, device=DEVICE), 0)), r"ready chunk: expected an"),
])
def test_bad_inputs_raise_before_launch(change, match):
    q, k, v, table, kv_lens = _args()
    args = dict(q=q, k_buffer=k, v_buffer=v, page_table=table, kv_lens=kv_lens, page_size=4)
    change(args)
    knobs = {name: args.pop(name) for name in list(args) if name in da.TUNING}  # launch knobs: the TUNING table
    with pytest.raises(SparseRefError, match=match), tuning(da.TUNING, **knobs):
        paged_decode_attention(**args)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_offload_flags_that_are_set_change_nothing(num_splits):
    """With every chunk's flag at 0 (the swap-in's copies landed), the launch that waits on them gives the plain
    launch's result bit for bit: the same table, order and splits; rows past the batch's flags are not read."""
    lens = [600, 0, 257, 1]  # over two chunks of READY_CHUNK entries, an empty row, a chunk's edge, one token
    q, k, v, table, kv_lens = make_case(lens, 4, 2, 8, 1, num_pages=700, seed=11)
    ready = torch.zeros(len(lens) + 2, 3, dtype=torch.int32, device=DEVICE)
    ready[len(lens):] = -1  # (rows of no request: a program that read them would spin)
    with tuning(da.TUNING, num_splits=num_splits):
        plain = paged_decode_attention(q, k, v, table, kv_lens, 1)
        waited = paged_decode_attention(q, k, v, table, kv_lens, 1, ready=(ready, 256))
    assert torch.equal(plain, waited)
    assert_matches_reference(waited, sparse_decode_attention(q, k, v, table, kv_lens, 1), "fp32")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter runs the launch on a thread of this process")
def test_the_launch_waits_for_the_flag_of_a_chunk_it_reads():
    """A chunk whose copies have not landed holds the launch back until its flag reaches 0; then the result is the
    plain launch's. (On a GPU the swap-in's copy programs set the flags; here the test does, from this thread.)"""
    import threading

    q, k, v, table, kv_lens = make_case([300], 2, 2, 8, 1, num_pages=400, seed=12)
    ready = torch.tensor([[0, -1]], dtype=torch.int32)  # entries 256..299: a unit still copying
    got = {}
    run = threading.Thread(target=lambda: got.update(out=paged_decode_attention(q, k, v, table, kv_lens, 1,
                                                                                ready=(ready, 256))), daemon=True)
    run.start()
    run.join(timeout=1.0)
    assert run.is_alive() and "out" not in got  # waiting on chunk 1
    ready[0, 1] = 0
    run.join(timeout=60)
    assert not run.is_alive() and torch.equal(got["out"], paged_decode_attention(q, k, v, table, kv_lens, 1))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU refusal without the interpreter")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SparseRefError, match="CUDA device"):
        paged_decode_attention(*_args(), 4)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    """Captured once on static buffers; new queries, tables and lengths copied in; replay == eager == reference."""
    P, bs = 16, 5
    case = make_case([0, 1, 16, 333, 1000], 32, 8, 128, P, torch.bfloat16, width=70, num_pages=400, seed=9)
    static = [t.clone() for t in case]
    out = torch.empty(case[0].shape, device="cuda")

    def call():
        paged_decode_attention(static[0], static[1], static[2], static[3], static[4], P, out=out)

    graph = capture_graph(call)  # warmed up on a side stream, then one call captured
    for seed in range(3):
        lens = [int(x) for x in torch.randint(0, 70 * P + 1, (bs,), generator=torch.Generator().manual_seed(seed))]
        fresh = make_case(lens, 32, 8, 128, P, torch.bfloat16, width=70, num_pages=400, seed=seed + 20)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = paged_decode_attention(*fresh, P)
        assert torch.equal(out, eager)
        torch.testing.assert_close(out, sparse_decode_attention(*fresh, P), rtol=1e-3, atol=1e-3)
    assert math.isfinite(float(out.abs().max()))


def test_default_split_counts_on_an_h200_sized_gpu(monkeypatch):
    """The split rule, evaluated for a 132-SM GPU without one: the counts whose timings the ``choose_num_splits``
    docstring quotes (short splits round down, long ones up), capped by the KV length."""
    from sparse_ref.kernels import decode_attention as da

    monkeypatch.setattr(da, "_sm_count", lambda index: 132)
    cuda, long = torch.device("cuda", 0), da.LONG_SPLIT_GQA
    assert da.choose_num_splits(1, 32, 32768, 32, cuda) == 33
    assert da.choose_num_splits(8, 8, 32768, 64, cuda, long) == 16  # 1024 programs, not 1088 (a nearly empty wave)
    assert da.choose_num_splits(8, 8, 65536, 64, cuda, long) == 16  # 4096 tokens a split: the long tile
    assert da.choose_num_splits(16, 8, 16384, 64, cuda, long) == 8
    assert da.choose_num_splits(64, 8, 2048, 64, cuda, long) == 1  # every SM holds two programs: no split
    assert da.choose_num_splits(64, 8, 4096, 64, cuda, long) == 2  # (4096 tokens: the long tile, split)
    assert da.choose_num_splits(32, 8, 2048, 64, cuda, long) == 4  # 256 programs: under two an SM
    assert da.choose_num_splits(64, 8, 32768, 64, cuda, long) == 3  # long splits round up
    assert da.choose_num_splits(64, 8, 32768, 64, cuda) == 2  # (no long tile: short splits round down)
    assert da.choose_num_splits(1, 32, 100, 32, cuda) == 4  # at most one split per block of 32 tokens
    assert da.choose_num_splits(1, 1, 10**7, 32, cuda) == da.MAX_SPLITS
    assert da.choose_num_splits(0, 8, 0, 64, cuda) == 1


@pytest.mark.knobs
@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("num_splits, block_n", [(1, 16), (3, 16), (2, 32)])
def test_the_running_max_moves_late_within_and_across_splits(rising, num_splits, block_n):
    """Scores that rise (or fall) steeply with the position: the running max moves in every block, so a
    sum or output not rescaled when it moves is off by orders of magnitude, within a split and in the merge."""
    page_size, n = 4, 77
    q = torch.ones(1, 2, 8)
    pos = torch.arange(24 * page_size, dtype=torch.float32)
    k = (pos if rising else -pos)[:, None, None].expand(-1, 1, 8) * 0.1  # score_t = +-0.1 * t * sqrt(8)
    v = torch.randn(24 * page_size, 1, 8, generator=torch.Generator().manual_seed(4))
    table = torch.arange(24, dtype=torch.int32)[None, :20]  # logical page j -> physical page j
    kv_lens = torch.tensor([n], dtype=torch.int32)
    case = [t.to(DEVICE) for t in (q, k.contiguous(), v, table, kv_lens)]
    got = check_against_reference(case, page_size, num_splits=num_splits, block_n=block_n)
    p = torch.softmax(0.1 * pos[:n] * (1 if rising else -1) * math.sqrt(8), 0)  # by hand, no reference
    torch.testing.assert_close(got[0, 0].cpu(), p @ v[:n, 0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (3, 3), (16, 1)])  # groups 4, 4, 1 (MHA) and 16 (not packed)
def test_two_term_dots_packed_or_not_equal_the_reference(monkeypatch, heads, pack):
    """The compiled path's two-term 16-bit dots (``PRECISE``), run in the interpreter on fp16 K/V (its fp16
    tl.dot is right; bf16 is not): the high and low halves of q and p packed into one dot's rows (``PACKED``,
    groups up to half the padded rows) or in two dots each. Both keep the fp32 reference's precision."""
    monkeypatch.setattr(da, "triton_interpreted", lambda: False)  # launch as compiled: 16-bit dots
    monkeypatch.setattr(da, "PACK_HALVES", pack)
    cfg = da.launch_config(heads[0] // heads[1], 12, torch.float16, False)["constexprs"]
    assert cfg["PRECISE"] and cfg["PACKED"] == (pack and heads[0] // heads[1] <= 8)
    q, k, v, table, kv_lens = make_case([0, 1, 6, 13, 16], *heads, 12, 4, torch.float16, width=4, seed=heads[0] + pack)
    want = sparse_decode_attention(q, k, v, table, kv_lens, 4)
    for num_splits in (1, 3):
        with tuning(da.TUNING, num_splits=num_splits):
            got = paged_decode_attention(q, k, v, table, kv_lens, 4)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        assert not got[0].any()


def test_long_splits_take_the_long_tile_only_on_16bit_tensor_cores():
    """``launch_config``'s tile from the split length: GQA 128 tokens and 2 stages from ``LONG_SPLIT_GQA``
    tokens a split, MHA 64 from ``LONG_SPLIT_MHA``; fp32 K/V, the interpreter and explicit knobs keep theirs."""
    def tile(group, split_len, kv_dtype=torch.bfloat16, interpreted=False, **knobs):
        cfg = da.launch_config(group, 128, kv_dtype, interpreted, split_len=split_len, **knobs)
        return cfg["constexprs"]["BLOCK_N"], cfg["options"].get("num_stages")

    assert tile(4, da.LONG_SPLIT_GQA) == (128, 2) and tile(4, da.LONG_SPLIT_GQA - 1) == (64, None)
    assert tile(1, da.LONG_SPLIT_MHA) == (64, None) and tile(1, da.LONG_SPLIT_MHA - 1) == (32, None)
    assert tile(4, 10**6, torch.float32) == (32, None) and tile(4, 10**6, interpreted=True) == (32, None)
    assert tile(4, 10**6, block_n=32) == (32, None) and tile(4, 10**6, num_stages=3) == (128, 3)
    assert tile(1, 10**6, torch.float16) == (64, None)


@pytest.mark.parametrize("heads", [(8, 2), (3, 3)])  # a GQA group of 4 (128-token tile) and MHA (64)
def test_long_splits_equal_the_reference(monkeypatch, heads):
    """One split over 4.1K-4.6K tokens (not a multiple of either tile) takes the long-split tile: compiled-path
    dots (fp16 in the interpreter, where fp16 tl.dot is right), against the fp32 reference."""
    monkeypatch.setattr(da, "triton_interpreted", lambda: False)  # launch as compiled: 16-bit dots
    page_size, width = 16, 290
    lens = [4100 + 37 * heads[0], 4099, 1]
    assert width * page_size >= max(lens) >= da.LONG_SPLIT_GQA
    cfg = da.launch_config(heads[0] // heads[1], 16, torch.float16, False, split_len=width * page_size)["constexprs"]
    assert cfg["BLOCK_N"] == (128 if heads[0] > heads[1] else 64)
    q, k, v, table, kv_lens = make_case(lens, *heads, 16, page_size, torch.float16, width=width, num_pages=300,
                                        seed=heads[0])
    want = sparse_decode_attention(q, k, v, table, kv_lens, page_size)
    with tuning(da.TUNING, num_splits=1):
        got = paged_decode_attention(q, k, v, table, kv_lens, page_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert got[2].abs().sum() > 0
