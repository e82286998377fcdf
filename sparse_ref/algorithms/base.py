"""The sparse-algorithm contract (lifecycle hooks) and the default page-granular retrieval.

Lifecycle, per layer ``start_layer <= layer < end_layer`` (``end_layer`` is exclusive,
everywhere in this package):

1. ``initialize_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool)``
   once, when the engine starts;
2. ``construct_representations(layer_id, forward_batch, k_buffer)`` after a prefill (EXTEND);
3. ``update_representations(layer_id, forward_batch, k_buffer)`` after each decode step;
4. ``retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kwargs)`` before
   attention, which returns what to read.
"""

from __future__ import annotations

import torch

from sparse_ref.config import SparseConfig


class SparseAlgorithm:
    """Base class. Subclasses fill in scoring; the default ``retrieve_topk`` is page-granular."""

    name = "base"

    def __init__(self, config: SparseConfig | None = None, device="cpu"):
        self.config = config if config is not None else SparseConfig()
        self.device = torch.device(device)
        self.start_layer = 0
        self.end_layer = 0
        self.token_to_kv_pool = None
        self.req_to_token_pool = None

    def initialize_representation_pool(self, start_layer: int, end_layer: int, token_to_kv_pool,
                                       req_to_token_pool) -> None:
        self.start_layer, self.end_layer = start_layer, end_layer
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token_pool = req_to_token_pool

    def construct_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a prefill: build whatever the algorithm scores with. Default: nothing."""

    def update_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a decode step: refresh representations. Default: nothing."""

    def retrieve_topk(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                      sparse_mask: torch.Tensor, **kwargs):
        raise NotImplementedError
