"""Tests for sparse_ref.errors: the hierarchy, the seed messages verbatim, and the tensor checks."""

import pytest
import torch

import sparse_ref
from sparse_ref import errors
from sparse_ref.errors import ShapeError, check_tensor, describe

SUBCLASSES = [errors.PoolError, errors.ConfigError, errors.BatchError, errors.RetrievalError, errors.ShapeError,
              errors.UnknownAlgorithmError]


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


def test_errors_is_a_leaf_module():
    """Kernel files may import sparse_ref.errors, so it must not import the rest of the package."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(errors))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("sparse_ref"), node.module
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("sparse_ref") for a in node.names)


def test_describe():
    assert describe(torch.zeros(2, 3, dtype=torch.int32)) == "tensor of shape (2, 3), dtype torch.int32, device cpu"
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
