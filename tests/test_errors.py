"""Tests for sparse_ref.errors and sparse_ref.checks: the hierarchy, the seed messages verbatim, the checks."""

import pytest
import torch

import sparse_ref
from sparse_ref import checks, errors
from sparse_ref.checks import check_tensor, describe
from sparse_ref.errors import ShapeError

SUBCLASSES = [errors.PoolError, errors.ConfigError, errors.BatchError, errors.RetrievalError, errors.ShapeError,
              errors.UnknownAlgorithmError, errors.RankError]


@pytest.mark.parametrize("cls", SUBCLASSES)
def test_every_error_is_a_sparse_ref_error_and_a_value_error(cls):
    assert issubclass(cls, errors.SparseRefError) and issubclass(cls, ValueError)
    with pytest.raises(ValueError, match="boom"):
        raise cls("boom")
    assert getattr(sparse_ref, cls.__name__) is cls


def test_every_exception_in_the_module_is_covered():
    found = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)}
    assert found == set(SUBCLASSES) | {errors.SparseRefError}
    assert issubclass(errors.SparseRefError, ValueError)


def test_seed_messages_verbatim():
    assert errors.SEED_TOPK_NEEDS_SEQ_LENS == "forward_batch with seq_lens is required for TopK retrieval"
    assert errors.SEED_DSA_REQUIRED == "Required: indexer, forward_batch, x, q_lora, positions"
    assert sparse_ref.SEED_TOPK_NEEDS_SEQ_LENS is errors.SEED_TOPK_NEEDS_SEQ_LENS
    assert sparse_ref.SEED_DSA_REQUIRED is errors.SEED_DSA_REQUIRED


@pytest.mark.parametrize("module, allowed", [(errors, {"sparse_ref.checks"}), (checks, {"sparse_ref.errors"})])
def test_errors_and_checks_are_leaf_modules(module, allowed):
    """Kernel files may import sparse_ref.errors and sparse_ref.checks: at import time these import nothing else of
    the package (an entry-point check that needs a class of the package, say ``ForwardBatch``, imports it inside the
    function, when its caller has long been imported)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:  # the module-level statements: what importing the module runs
        if isinstance(node, ast.ImportFrom):
            name = node.module if node.module != "sparse_ref" else f"sparse_ref.{node.names[0].name}"
            assert not name.startswith("sparse_ref") or name in allowed, name
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("sparse_ref") for a in node.names)


def test_describe():
    assert describe(torch.zeros(2, 3, dtype=torch.int32)) == "a tensor of shape (2, 3), dtype torch.int32, device cpu"
    assert describe([1, 2]) == "list [1, 2]"
    assert len(describe("x" * 1000)) == 200


def test_check_tensor_accepts_good_input():
    check_tensor("x", torch.zeros(2, 3), dtype=torch.float32, dims=2, device="cpu")
    check_tensor("x", torch.zeros(2, dtype=torch.int64), dtype=(torch.int32, torch.int64), dims=(1, 2))


@pytest.mark.parametrize(
    "t,kwargs,match",
    [
        ([1, 2], {}, r"x: expected a torch.Tensor, got list \[1, 2\]\. Fix: pass a tensor"),
        (torch.zeros(2), {"dtype": torch.int32}, r"x: expected dtype torch.int32, got torch.float32\. Fix"),
        (torch.zeros(2), {"dtype": (torch.int32, torch.int64)}, r"expected dtype torch.int32 or torch.int64"),
        (torch.zeros(2), {"dims": 2}, r"x: expected a 2-D tensor, got shape \(2,\)"),
        (torch.zeros(2), {"dims": (2, 3)}, r"expected a 2-D or 3-D tensor"),
        (torch.zeros(2), {"device": "cuda"}, r"x: expected a tensor on cuda, got one on cpu"),
    ],
)
def test_check_tensor_errors(t, kwargs, match):
    with pytest.raises(ShapeError, match=match):
        check_tensor("x", t, fix="pass a tensor", **kwargs)


def test_check_tensor_refuses_meta_and_checks_shape():
    with pytest.raises(ShapeError, match="x: expected a tensor with data"):
        check_tensor("x", torch.zeros(2, device="meta"))
    with pytest.raises(ShapeError, match=r"x: expected shape \[any, 3\], got shape \(2, 4\)"):
        check_tensor("x", torch.zeros(2, 4), shape=(None, 3))


def test_check_int_and_float_and_range():
    assert checks.check_int("n", torch.tensor(3)) == 3
    for bad in (2.5, True, None, "3", torch.tensor(1.0)):
        with pytest.raises(errors.ConfigError, match="n: expected an int"):
            checks.check_int("n", bad)
    with pytest.raises(errors.ConfigError, match=r"n: expected an int in \[0, 5\], got 6"):
        checks.check_int("n", 6, low=0, high=5)
    with pytest.raises(errors.ConfigError, match=r"r: expected a finite number in \(0, 1\], got float nan"):
        checks.check_float("r", float("nan"), low=0, high=1, low_open=True)
    with pytest.raises(ShapeError, match=r"ids: expected values in \[0, 3\], got min -1, max 2"):
        checks.check_range("ids", torch.tensor([-1, 2]), 0, 3)
