"""One engine decode step, every layer, captured in ONE CUDA graph and replayed step after step.

``GraphedDecodeStep`` keeps the host half of ``DecodeEngine.step`` on the host (``decode_step``: pages,
``req_to_token``, the batch; the workload's Q/K/V) and captures the device half (``forward``: kernels and
tensor ops only) once, on *static* tensors. Each ``step()`` redoes the host half, copies its results into
the static tensors in place (``copy_``: the graph reads their addresses) and replays the graph, as
SGLang's ``CudaGraphRunner`` does. A replay needs the same requests in the same order as at capture
(``step()`` checks, ``BatchError`` otherwise; capture anew after a join or leave); lengths, new pages and
the table width need nothing new. The first ``step()`` runs the device half for real, captures and
replays it (a step replayed twice writes the same slot and bounds again); on a CPU it runs eagerly on the
same static tensors. ``docs/design.md`` section 3.10 says what a replay assumes and why.
"""
from __future__ import annotations

import torch

from sparse_ref.batch import ForwardBatch, ForwardMode, decode_step
from sparse_ref.checks import describe, fail
from sparse_ref.engine import DecodeEngine, check_engine_step
from sparse_ref.errors import BatchError, ConfigError


class GraphedDecodeStep:
    """The device half of ``engine``'s decode step for its current live requests, as one CUDA graph."""

    def __init__(self, engine):
        check_graphed_engine(engine)
        if not engine.live:
            fail("engine.live", "at least one live request to capture a step for", "none",
                 "add_request first; the graph is captured for the batch that is live now.", BatchError)
        if engine.device.type == "cuda" and not engine.backend.compiled:
            fail("engine.backend", "'triton' on CUDA (the kernels need no host sync)",
                 repr(engine.backend.name), "build the engine with backend='triton' or 'auto'.",
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
            self.batch.stamp(self.engine.manager, self.engine.live)  # the copy of decode_step's batch, now
            self.inputs = [tuple(None if t is None else t.clone() for t in layer) for layer in inputs]
            return
        assert torch.equal(batch.req_pool_indices, self.batch.req_pool_indices), "same requests, same rows"
        for name in ("seq_lens", "positions", "out_cache_loc"):
            getattr(self.batch, name).copy_(getattr(batch, name))
        self.batch.stamp(self.engine.manager, self.engine.live)  # they hold exactly decode_step's batch's values
        for static, fresh in zip(self.inputs, inputs, strict=True):
            for s, f in zip(static, fresh, strict=True):
                if s is not None:
                    s.copy_(f)

    def run_device_half(self):
        """``engine.forward`` on the static tensors, eagerly: what the graph holds. Returns fresh traces.

        Refused (BatchError) unless the static tensors still describe the engine's requests (see ``replay``)."""
        check_graph_current(self)
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
        check_graph_current(self)
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
        check_engine_step(engine)  # every request as the engine left it, before anything grows
        batch = decode_step(engine.manager, engine.live)
        self._load(batch, [engine.decode_inputs(layer) for layer in range(engine.manager.token_to_kv_pool.num_layers)])
        self.generation = engine.manager.generation
        if self.graph is None and engine.device.type == "cuda":
            self._capture()
        self._replay()
        engine.mark_written()
        return self.traces


# ------------------------------ argument checks (each entry point above calls one first)
def check_graphed_engine(engine) -> None:
    if not isinstance(engine, DecodeEngine):
        fail("engine", "a sparse_ref.engine.DecodeEngine", describe(engine), error=ConfigError)
    if engine.offload is not None and engine.backend.syncs:
        fail("engine", "an offload engine with backend 'triton' (its swap-in kernel needs no host sync; "
             "the torch reference reads each selection on the host: not capturable)",
             f"backend={engine.backend.name!r}", "build the engine with backend='triton' "
             "or 'auto' on CUDA, or step it eagerly (engine.step()).", ConfigError)


def check_graph_current(step) -> None:
    """The static tensors still describe the engine's requests: loaded, and the manager's generation unchanged."""
    generation = step.engine.manager.generation
    if step.generation is None:
        raise BatchError("GraphedDecodeStep: nothing to replay yet. Fix: call step(), which loads the batch.")
    if generation != step.generation:
        raise BatchError(
            f"GraphedDecodeStep: the engine changed since step() loaded the batch (a request joined, left or grew: "
            f"generation {step.generation} -> {generation}); a replay would write K/V into slots and read pages "
            "that no longer belong to these requests. Fix: call step() (the host half, then the replay), or "
            "capture a new GraphedDecodeStep(engine) after requests join or leave."
        )
