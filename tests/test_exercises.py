"""The notebooks' exercises: every notebook has at least two; each solution passes its checker, each stub fails.

A solution is a code cell tagged ``solution`` (``scripts/student_copy.py``); it ends with a checker call
from ``notebooks/checkers.py``. Here each solution runs with the notebook's imports only (so it cannot lean
on the lesson's variables), then the student copy's stub of the same cell must raise NotImplementedError.
"""

import ast
import linecache
import runpy
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
student = runpy.run_path(str(ROOT / "scripts" / "student_copy.py"))
sys.path.insert(0, str(ROOT / "notebooks"))  # the notebooks import checkers and drawing from their folder
sys.path.insert(0, str(ROOT / "kernels"))  # ... and the lesson kernels (drawing.use_lesson_kernels())


def run(source: str, namespace: dict, name: str) -> None:
    """exec ``source`` as a file named ``name`` (registered, so Triton and inspect can read its source)."""
    filename = f"<exercise {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def imports_of(nb) -> str:
    """Every top-level import statement of the notebook's code cells."""
    lines = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            source = "\n".join(line for line in cell.source.splitlines() if not line.startswith(("%", "!")))
            lines += [ast.get_source_segment(source, node) for node in ast.parse(source).body
                      if isinstance(node, (ast.Import, ast.ImportFrom))]
    return "\n".join(lines)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_solutions_pass_their_checkers_and_stubs_fail_them(path, capsys):
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if student["is_solution"](c)]
    assert len(cells) >= 2, f"{path.name}: {len(cells)} exercises, want at least 2"
    namespace: dict = {"__name__": "__main__"}  # as in a notebook (the launch recorder keeps such kernels' source)
    run(imports_of(nb), namespace, f"{path.stem} imports")
    for i, cell in enumerate(cells):
        last = ast.parse(cell.source).body[-1]
        assert isinstance(last, ast.Expr) and isinstance(last.value, ast.Call), f"{path.name} exercise {i}: " \
            "the cell must end with its checker call"
        assert ast.unparse(last.value.func).startswith("checkers.check_"), ast.unparse(last.value.func)
        run(cell.source, namespace, f"{path.stem} solution {i}")
        assert capsys.readouterr().out.strip().endswith("correct")
        with pytest.raises(NotImplementedError, match="exercise: write"):
            run(student["stub_source"](cell.source), dict(namespace), f"{path.stem} stub {i}")


def test_the_student_copy_replaces_every_solution_and_nothing_else(tmp_path):
    assert student["main"]([str(p) for p in NOTEBOOKS] + ["--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in NOTEBOOKS} | {"checkers.py", "drawing.py"}
    for path in NOTEBOOKS:
        original, copy = nbformat.read(path, as_version=4), nbformat.read(tmp_path / path.name, as_version=4)
        assert len(original.cells) == len(copy.cells)
        for a, b in zip(original.cells, copy.cells, strict=True):
            if student["is_solution"](a):
                assert "NotImplementedError" in b.source and "exercise" in b.metadata["tags"]
                assert b.source.splitlines()[-1] == a.source.splitlines()[-1], "the checker call stays"
            else:
                assert a.source == b.source


def test_stub_source_keeps_signatures_docstrings_and_decorators():
    source = '''# solution
@decorate
def f(x, y=2):
    """Doc."""
    return x + y


def g():
    return 1


check(f)'''
    stub = student["stub_source"](source)
    assert "# solution" not in stub and "@decorate\ndef f(x, y=2):\n    \"\"\"Doc.\"\"\"\n    raise" in stub
    assert "return" not in stub and stub.endswith("check(f)")
    assert 'def g():\n    raise NotImplementedError("exercise: write g, then run this cell")' in stub


# ---------------------------------------------------------------- the Triton exercises reject plausible mistakes
def _checkers():
    import checkers

    return checkers


def _masked(x, lengths):
    cols = torch.arange(x.shape[1], device=x.device)
    return torch.where(cols[None, :] < lengths[:, None], x, float("-inf"))


def test_row_argmax_checker_rejects_nan_as_a_winner():
    def nan_wins(x, lengths):  # torch.argmax takes NaN as the maximum, and an empty row as id 0
        return _masked(x, lengths).argmax(1).int()

    with pytest.raises(AssertionError, match="NaN|short and empty"):
        _checkers().check_row_argmax(nan_wins)


def test_row_argmax_checker_rejects_ties_to_the_higher_id():
    def last_of_ties(x, lengths):
        v = _masked(x, lengths).nan_to_num(nan=float("-inf"))
        ids = v.shape[1] - 1 - v.flip(1).argmax(1)
        return torch.where(torch.isneginf(v.amax(1)), -1, ids).int()

    with pytest.raises(AssertionError, match="ties|-0.0"):
        _checkers().check_row_argmax(last_of_ties)


def _package_table(selected, lengths, seq_lens, rows, req_to_token, page_size):
    from sparse_ref.kernels.page_table import page_table_from_selection

    return page_table_from_selection(selected, lengths, lengths > 0, seq_lens, rows, req_to_token, page_size)[:2]


def test_page_table_checker_accepts_the_package_and_rejects_a_whole_last_page():
    _checkers().check_page_table_kernel(_package_table)

    def whole_pages(*args):  # kv_len counts the last kept page as full
        table, kv = _package_table(*args)
        return table, torch.where(args[1] > 0, args[1].int() * args[5], kv)

    with pytest.raises(AssertionError, match="kv_lens"):
        _checkers().check_page_table_kernel(whole_pages)


def test_page_table_checker_rejects_empty_dense_rows():
    def dense_rows_empty(*args):  # a dense row (length 0) left without its pages
        table, kv = _package_table(*args)
        return torch.where((args[1] > 0)[:, None], table, 0), kv

    with pytest.raises(AssertionError, match="page_table"):
        _checkers().check_page_table_kernel(dense_rows_empty)


def test_stub_of_a_one_line_def_parses_and_raises():
    stub = student["stub_source"]("# solution\ndef f(x): return x + 1\n\n\n@deco\ndef g(): return 2\n\ncheck(f)")
    ast.parse(stub)
    assert "def f(x):\n    raise NotImplementedError" in stub and "@deco\ndef g():\n    raise" in stub
    namespace = {"deco": lambda fn: fn, "check": lambda fn: fn(1)}
    with pytest.raises(NotImplementedError, match="exercise: write f"):
        exec(compile(stub, "stub", "exec"), namespace)


def test_student_copy_refuses_to_overwrite_the_notebooks(tmp_path, capsys):
    source = tmp_path / "notebooks"
    source.mkdir()
    nb = NOTEBOOKS[0]
    (source / nb.name).write_bytes(nb.read_bytes())
    before = (source / nb.name).read_bytes()
    with pytest.raises(SystemExit) as info:
        student["main"]([str(source / nb.name), "--out", str(source)])
    assert info.value.code == 2 and "--out" in capsys.readouterr().err
    assert (source / nb.name).read_bytes() == before


# ---------------------------------------------------------------- a missing mask fails, with a sentence saying why
# (module level: the compile check re-imports every kernel a test launched, by module and name)
@triton.jit
def unmasked_max(x_ptr, out_ptr, N, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, N, BLOCK):
        best = tl.maximum(best, tl.load(x_ptr + row * stride + start + tl.arange(0, BLOCK)))  # no mask
    tl.store(out_ptr + row, tl.max(best, axis=0))


@triton.jit
def unmasked_top1(x_ptr, len_ptr, out_ptr, N, BLOCK: tl.constexpr):  # the lengths and the tail ignored
    r = tl.program_id(0)
    ids = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + r * N + ids)
    v = tl.where(v == v, v, float("-inf"))
    m = tl.max(v, axis=0)
    tl.store(out_ptr + r, tl.min(tl.where(v == m, ids, BLOCK), axis=0))


@triton.jit
def writes_lengths(x_ptr, len_ptr, out_ptr, N, BLOCK: tl.constexpr):  # scribbles past the lengths it read
    r = tl.program_id(0)
    tl.store(len_ptr + r + 4096, 0)
    tl.store(out_ptr + r, -1)


def test_a_row_max_kernel_without_its_mask_is_rejected_as_reading_outside():
    def row_max(x):
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        unmasked_max[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=128)
        return out

    with pytest.raises(AssertionError, match="a load past a tensor without a mask"):
        _checkers().check_row_max(row_max)


def test_a_top1_kernel_that_stores_past_its_output_or_reads_past_its_row_is_rejected():
    def launcher(kernel):
        def row_argmax(x, lengths):
            out = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
            kernel[(x.shape[0],)](x, lengths, out, x.shape[1], BLOCK=2048)
            return out
        return row_argmax

    with pytest.raises(AssertionError, match="a load past a tensor without a mask"):
        _checkers().check_row_argmax(launcher(unmasked_top1))
    with pytest.raises(AssertionError, match="wrote outside lengths"):
        _checkers().check_row_argmax(launcher(writes_lengths))


# ---------------------------------------------------------------- 05's puzzles: each checker rejects two mistakes
@triton.jit
def copy_unmasked(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def bias_unmasked_columns(x_ptr, b_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = rows[:, None] < R  # the column edge forgotten
    offs = rows[:, None] * C + cols[None, :]
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=inside) + tl.load(b_ptr + cols)[None, :], mask=inside)


@triton.jit
def row_sum_unmasked(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        total += tl.load(x_ptr + row * N + start + tl.arange(0, BLOCK))
    tl.store(out_ptr + row, tl.sum(total, axis=0))


@triton.jit
def keep_positive_unmasked(x_ptr, out_ptr, count_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)  # past N: the sentinels, positive
    keep = x > 0
    tl.store(out_ptr + tl.cumsum(keep.to(tl.int32), axis=0) - 1, x, mask=keep)
    tl.store(count_ptr, tl.sum(keep.to(tl.int32), axis=0))


@triton.jit
def histogram_unmasked(x_ptr, out_ptr, N, BINS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr + tl.arange(0, BINS), tl.histogram(tl.load(x_ptr + offs), BINS))


@triton.jit
def dot_unmasked_k(a_ptr, b_ptr, out_ptr, M, N, K, B: tl.constexpr):
    rows = tl.program_id(0) * B + tl.arange(0, B)
    cols = tl.program_id(1) * B + tl.arange(0, B)
    acc = tl.zeros([B, B], tl.float32)
    for k0 in range(0, K, B):  # the K edge unmasked: past K, a's next row and b's sentinels
        ks = k0 + tl.arange(0, B)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(b_ptr + ks[:, None] * N + cols[None, :], mask=cols[None, :] < N, other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def softmax_tail_zero(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    m, s = tl.full([], float("-inf"), tl.float32), tl.zeros([], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)  # a masked lane as 0, not -inf: exp(0) counts
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)
        tl.store(out_ptr + row * N + cols, tl.exp(x - m) / s, mask=cols < N)


@triton.jit
def gather_unmasked(pool_ptr, table_ptr, out_ptr, D: tl.constexpr, P: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BD)
    tl.store(out_ptr + t * D + d, tl.load(pool_ptr + (tl.load(table_ptr + t // P) * P + t % P) * D + d))


def _grid1(n, block):
    return (triton.cdiv(n, block),)


PUZZLES = {  # checker name -> (a kernel with a mask missing, a plausible mistake in torch)
    "masked_copy": (lambda x, out: copy_unmasked[_grid1(x.numel(), 256)](x, out, x.numel(), BLOCK=256),
                    lambda x, out: out[:256].copy_(x[:256])),  # the first block only
    "add_column_bias": (lambda x, b, out: bias_unmasked_columns[(triton.cdiv(x.shape[0], 16), triton.cdiv(
        x.shape[1], 32))](x, b, out, *x.shape, BR=16, BC=32), lambda x, b, out: out.copy_(x + b.mean())),
    "row_sum": (lambda x, out: row_sum_unmasked[(x.shape[0],)](x, out, x.shape[1], BLOCK=512),
                lambda x, out: out.copy_(x.mean(1))),
    "keep_positive": (lambda x, out, count: keep_positive_unmasked[(1,)](x, out, count, x.numel(), BLOCK=1024),
                      lambda x, out, count: (out[:int((x >= 0).sum())].copy_(x[x >= 0]),  # zero kept
                                             count.fill_(int((x >= 0).sum())))),
    "histogram": (lambda x, out: histogram_unmasked[_grid1(x.numel(), 1024)](x, out, x.numel(), BINS=out.numel(),
                                                                             BLOCK=1024),
                  lambda x, out: out.copy_(torch.bincount(x[:1024].long(), minlength=out.numel()))),
    "dot_tile": (lambda a, b, out: dot_unmasked_k[(triton.cdiv(a.shape[0], 16), triton.cdiv(b.shape[1], 16))](
        a, b, out, a.shape[0], b.shape[1], a.shape[1], B=16), lambda a, b, out: out.copy_(a[:, :16] @ b[:16])),
    "online_softmax": (lambda x, out: softmax_tail_zero[(x.shape[0],)](x, out, x.shape[1], BLOCK=1024),
                       lambda x, out: out.copy_(torch.cat([torch.softmax(c, 1) for c in x.split(1024, 1)], 1))),
    "gather_pages": (lambda pool, table, out: gather_unmasked[(out.shape[0],)](
        pool, table, out, D=pool.shape[1], P=4, BD=triton.next_power_of_2(pool.shape[1])),
        lambda pool, table, out: out.copy_(pool[:out.shape[0]])),  # the pages in order, not through the table
}


# ---------------------------------------------------------------- the memory picture's trace (notebooks/drawing.py)
@triton.jit
def copy_masked(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the trace runs the kernel through the interpreter (CPU)")
def test_the_memory_trace_shows_each_programs_elements_and_its_masked_lanes():
    import drawing

    images = drawing.trace_memory(copy_masked, (3,), torch.randn(20), torch.empty(20), 20, BLOCK=8)
    assert set(images) == {"x_ptr", "out_ptr"}
    want = [0] * 8 + [1] * 8 + [2] * 4 + [drawing.MASKED_OFF] * 4 + [-1] * 12  # program 2 masks 4 lanes past 20
    assert images["x_ptr"][0].tolist() == want and images["x_ptr"][1].tolist() == [-1] * 36  # loaded, not stored
    assert images["out_ptr"][1].tolist() == want and images["out_ptr"][0].tolist() == [-1] * 36


@pytest.mark.skipif(torch.cuda.is_available(), reason="the trace runs the kernel through the interpreter (CPU)")
def test_the_memory_trace_marks_an_unmasked_access_outside_the_tensor():
    import drawing

    buffer = torch.zeros(64)  # x and out inside a larger buffer: reading past them is harmless here
    x, out = buffer[8:28], torch.zeros(64)[8:28]
    images = drawing.trace_memory(copy_unmasked, (3,), x, out, 20, BLOCK=8)
    assert images["x_ptr"][0, 20:24].tolist() == [drawing.OUTSIDE] * 4  # the last program's 4 lanes past the end
    assert images["out_ptr"][1, 20:24].tolist() == [drawing.OUTSIDE] * 4
    assert (images["x_ptr"][0, :20] >= 0).all()
