"""One engine decode step, every layer, captured in ONE CUDA graph and replayed step after step.

A decode step of ``DecodeEngine`` has two halves:

* **host** (``DecodeEngine.step`` before ``forward``): ``decode_step`` grows every request by one
  token (taking a fresh page from the allocator when a request's last page is full, writing the new
  slot into ``req_to_token``) and builds the DECODE batch; the workload makes each layer's Q/K/V of
  the new token. Python, lists, a page allocator: none of it can live in a CUDA graph.
* **device** (``DecodeEngine.forward``): per layer, the new token's K/V into the pool ->
  ``attention_begin`` (Quest scores -> page selection -> page table; DSA: indexer -> positions) ->
  paged decode attention -> ``attention_end`` (Quest: the bounds of a page this step filled).
  Kernels and tensor ops only, no host sync: a CUDA graph can hold all of it.

``GraphedDecodeStep`` keeps the host half on the host and captures the device half once, on
*static* tensors (the batch's ``seq_lens``, ``positions``, ``out_cache_loc`` and every layer's
Q/K/V inputs). Each ``step()`` redoes the host half, copies its results into the static tensors
in place (``copy_``: the graph reads their addresses) and replays the graph: one launch for the
whole step instead of dozens per layer. SGLang's ``CudaGraphRunner`` works the same way: its
scheduler allocates ``out_cache_loc`` on the host, copies the batch into static buffers and replays.

What a replay assumes (``step()`` checks it before changing anything, ``BatchError`` otherwise):

* **the same requests, in the same order** as at capture: the batch size and every request's
  ``req_to_token`` row are baked into the graph. After a request joins or leaves, capture anew
  (``GraphedDecodeStep(engine)``); real servers capture one graph per batch size and pad.
* lengths, pages and the page table's width need no new capture: the graph reads ``seq_lens``
  and ``req_to_token`` from memory, and every table has the static width of ``max_context_len``.
  So a request crossing into a new page is fine (the host allocated it before the replay); one
  that would outgrow ``max_context_len``, or a pool out of pages, fails in ``decode_step`` with a
  ``PoolError`` before anything is written.

The first ``step()`` runs the device half for real (the warm-up: Triton compiles, the allocator
settles), captures it, and replays it; replaying a step twice on the same inputs writes the same
K/V slot and the same bounds again, so this is safe. On a CPU there is no CUDA graph: ``step()``
runs the same device half eagerly on the same static tensors (the tests use that). The dense
oracle of ``compare_dense`` is not part of the graph (compare with ``engine.step()`` instead).
"""

from __future__ import annotations

import torch

from sparse_ref import checks
from sparse_ref.batch import ForwardBatch, ForwardMode, decode_step
from sparse_ref.checks import fail
from sparse_ref.errors import BatchError, ConfigError


class GraphedDecodeStep:
    """The device half of ``engine``'s decode step for its current live requests, as one CUDA graph."""

    def __init__(self, engine):
        checks.check_graphed_engine(engine)
        if not engine.live:
            fail("engine.live", "at least one live request to capture a step for", "none",
                 "add_request first; the graph is captured for the batch that is live now.", BatchError)
        if engine.device.type == "cuda" and engine.attention_backend != "triton":
            fail("engine.attention_backend", "'triton' on CUDA (the paged kernel needs no host sync)",
                 repr(engine.attention_backend), "build the engine with attention_backend='triton' or 'auto'.",
                 ConfigError)
        self.engine, self.rids = engine, [r.rid for r in engine.live]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.batch: ForwardBatch | None = None  # static: the graph reads these tensors' addresses
        self.inputs: list[tuple] | None = None  # static: per layer (q, k, v, x, q_lora)
        self.traces = None  # per layer: the metadata and output the last replay wrote (overwritten by the next)
        self.generation = None  # the manager's generation when the static tensors were loaded (None: not yet)

    def _check_batch(self) -> None:
        rids = [r.rid for r in self.engine.live]
        if rids != self.rids:
            fail("engine.live", f"the requests captured, in order: {self.rids}", f"{rids}",
                 "a request joined or left: capture a new GraphedDecodeStep(engine) for this batch.", BatchError)

    def _load(self, batch: ForwardBatch, inputs: list[tuple]) -> None:
        """The host half's results into the static tensors, in place (the first call allocates them)."""
        if self.batch is None:
            self.batch = ForwardBatch(ForwardMode.DECODE, batch.req_pool_indices.clone(), batch.seq_lens.clone(),
                                      batch.positions.clone(), batch.out_cache_loc.clone())
            self.inputs = [tuple(None if t is None else t.clone() for t in layer) for layer in inputs]
            return
        assert torch.equal(batch.req_pool_indices, self.batch.req_pool_indices), "same requests, same rows"
        for name in ("seq_lens", "positions", "out_cache_loc"):
            getattr(self.batch, name).copy_(getattr(batch, name))
        for static, fresh in zip(self.inputs, inputs, strict=True):
            for s, f in zip(static, fresh, strict=True):
                if s is not None:
                    s.copy_(f)

    def run_device_half(self):
        """``engine.forward`` on the static tensors, eagerly: what the graph holds. Returns fresh traces.

        Refused (BatchError) unless the static tensors still describe the engine's requests (see ``replay``)."""
        checks.check_graph_current(self)
        traces, _ = self.engine.forward(self.batch, self.inputs)
        return traces

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: compiles kernels, and runs this step
            self.run_device_half()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.traces = self.run_device_half()  # recorded, not run: these tensors are the graph's outputs

    def replay(self) -> None:
        """Run the captured device half again on the static tensors (the bench times this).

        Refused (BatchError) when the engine changed since ``step()`` loaded them: a request joined, left or
        grew (the manager's generation moved), so the graph would write K/V into slots and read pages that no
        longer belong to these requests. Replaying the same step twice writes the same K/V and bounds again."""
        checks.check_graph_current(self)
        self._replay()

    def _replay(self) -> None:
        if self.graph is None:
            self.traces = self.engine.forward(self.batch, self.inputs)[0]
        else:
            self.graph.replay()

    def step(self):
        """One decode step: check the batch, host half, load the static tensors, replay. Returns the traces.

        The traces' tensors are the graph's outputs: the next step overwrites them (clone to keep).
        """
        self._check_batch()
        engine = self.engine
        batch = decode_step(engine.manager, engine.live)
        self._load(batch, [engine.decode_inputs(layer) for layer in range(engine.manager.token_to_kv_pool.num_layers)])
        self.generation = engine.manager.generation
        if self.graph is None and engine.device.type == "cuda":
            self._capture()
        self._replay()
        return self.traces
