"""Triton kernels, installed as ``sparse_ref.kernels`` (never as a top-level ``kernels``).

One module per kernel family; each holds a kernel and its launcher with input
checks. The torch references they must match live in ``sparse_ref``. Importing
this package goes through ``sparse_ref/__init__.py`` first, which turns on
Triton's interpreter when there is no GPU.
"""
