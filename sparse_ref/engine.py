"""A small decode engine: the whole sparse lifecycle in order, sparse beside dense.

``DecodeEngine`` owns a ``KVCacheManager`` and ``L`` layers, each dense, Quest or DSA. Requests join
(``add_request``) and leave (``finish``) between decode steps; ``step()`` decodes one token per live
request in two halves: the host half (``decode_step``; the workload makes Q/K/V) and the device half
``forward`` (every layer through the coordinator), which ``sparse_ref.engine_graph`` captures in one CUDA
graph. ``SparseCoordinator`` is the glue, with the hook names and order of SGLang's
``SparseCoordinator``: ``on_request_begin`` / ``on_request_end``, ``forward_begin``, per layer
``attention_begin`` (sparse mask -> ``retrieve_topk`` -> the adaptor's page table) and ``attention_end``
(the representation hooks), ``forward_end``. DSA's positions become a page table at page size 1.
``docs/design.md`` section 3.10 maps each hook to SGLang's and says what the halves may contain.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparse_ref.adaptor import Metadata, to_attention_metadata
from sparse_ref.algorithms import create_sparse_algorithm
from sparse_ref.backend import choose_backend
from sparse_ref.batch import ForwardBatch, ForwardMode, build_extend_batch, check_batch_slots, decode_step
from sparse_ref.checks import capturing, check_device, check_int, describe, fail, values_checked
from sparse_ref.config import SparseConfig
from sparse_ref.errors import BatchError, ConfigError, PoolError
from sparse_ref.memory import IndexerKeyCache, KVCacheManager, Request, check_request

ALGORITHMS = (None, "quest", "deepseek_dsa")


@dataclass
class LayerTrace:
    """One layer of one decode step, everything a learner may want to print."""

    layer: int
    algorithm: str
    metadata: Metadata
    out: torch.Tensor  # [bs, H_q, D] fp32
    dense_out: torch.Tensor | None = None
    recall: torch.Tensor | None = None  # [bs]
    mass_kept: torch.Tensor | None = None
    output_error: torch.Tensor | None = None
    offload: Metadata | None = None  # offload mode: what attention read, hot-buffer slots at page size 1


@dataclass
class StepResult:
    rids: list[int]
    seq_lens: torch.Tensor
    layers: list[LayerTrace] = field(default_factory=list)
    sparse_time_s: float = 0.0  # ``forward``, all layers (K/V append, retrieval, page table, attention, update)
    dense_time_s: float = 0.0  # dense attention alone, same backend, all layers (compare_dense only)
    offload_hits: int = 0  # offload mode: tokens read this step that the hot buffers held (all layers) ...
    offload_misses: int = 0  # ... and those copied in from the host pool


class SparseCoordinator:
    """SGLang's coordinator hooks over per-layer algorithms (see the module docstring)."""

    def __init__(self, manager: KVCacheManager, algorithms: Sequence[str | None], configs: Sequence[SparseConfig],
                 workload, dsa_topk: int, device, bounds_dtype=torch.float32, backend="auto"):
        self.manager, self.configs, self.device = manager, list(configs), torch.device(device)
        self.backend = backend = choose_backend(backend, self.device)
        pool, req_pool = manager.token_to_kv_pool, manager.req_to_token_pool
        self.algorithms, self.indexers, self.prompt_lens = [], {}, {}
        self.dense: Metadata | None = None
        index_cache = None
        for layer, (name, cfg) in enumerate(zip(algorithms, self.configs, strict=True)):
            kw = {"bounds_dtype": bounds_dtype} if name == "quest" else {}
            algo = None if name is None else create_sparse_algorithm(name, cfg, self.device, backend=backend, **kw)
            if name == "quest":  # freed pages drop their bounds (no stale bounds for the next owner)
                algo.initialize_representation_pool(layer, layer + 1, pool, req_pool, page_allocator=manager.allocator)
            elif name == "deepseek_dsa":
                algo.initialize_representation_pool(layer, layer + 1, pool, req_pool)
                self.indexers[layer] = workload.indexer(layer, dsa_topk, self.device, backend)
                if index_cache is None:  # one cache for every DSA layer; it forgets the keys of freed pages
                    index_cache = IndexerKeyCache.for_manager(manager, self.indexers[layer].config)
                self.indexers[layer].attach_cache(index_cache)
            self.algorithms.append(algo)

    def name(self, layer: int) -> str:
        algo = self.algorithms[layer]
        return "dense" if algo is None else algo.name

    def on_request_begin(self, req: Request, prompt_len: int) -> None:
        check_request_begin(self, req, prompt_len)
        self.prompt_lens[req.req_pool_idx] = prompt_len

    def on_request_end(self, req: Request) -> None:
        check_request_end(self, req)
        del self.prompt_lens[req.req_pool_idx]

    def forward_begin(self, batch: ForwardBatch) -> None:
        """Build the dense metadata once per step (what a dense layer reads, and what sparse layers replace)."""
        bs = batch.batch_size
        none = torch.full((bs, 1), -1, dtype=torch.int32, device=self.device)
        zeros, dense_mask = torch.zeros(bs, dtype=torch.int32, device=self.device), torch.zeros_like(none[:, 0]).bool()
        table, kv_lens, _ = to_attention_metadata(none, zeros, dense_mask, batch, self.manager.req_to_token_pool
                                                  .req_to_token, self.manager.page_size, backend=self.backend)
        self.dense = Metadata(table, kv_lens, self.manager.page_size)

    def attention_begin(self, layer: int, queries: torch.Tensor, batch: ForwardBatch, **kwargs) -> Metadata:
        """Sparse mask -> ``retrieve_topk`` -> adaptor, as the algorithm's one call (``retrieve_attention_metadata``;
        DSA's positions at page size 1); the dense metadata for a dense layer. The bench times the same call."""
        algo = self.algorithms[check_coordinator_layer(self, layer)]
        if algo is None:
            return self.dense
        sparse_mask = batch.seq_lens >= self.configs[layer].min_sparse_seq_len  # current lengths, every step
        if layer in self.indexers:
            kwargs.update(indexer=self.indexers[layer], positions=batch.positions)
        selected, lengths, table, kv_lens, _ = algo.retrieve_attention_metadata(
            queries, layer, batch.req_pool_indices, sparse_mask, batch, self.manager.req_to_token_pool.req_to_token,
            **kwargs)
        return Metadata(table, kv_lens, 1 if layer in self.indexers else self.manager.page_size, selected, lengths,
                        sparse_mask)

    def attention_end(self, layer: int, batch: ForwardBatch) -> None:
        """Build representations after a prefill, refresh them after a decode step."""
        algo = self.algorithms[check_coordinator_layer(self, layer)]
        if algo is None:
            return
        k_buffer = self.manager.token_to_kv_pool.get_key_buffer(layer)
        if batch.forward_mode is ForwardMode.EXTEND:
            algo.construct_representations(layer, batch, k_buffer)
        else:
            algo.update_representations(layer, batch, k_buffer)

    def forward_end(self, batch: ForwardBatch) -> None:
        self.dense = None  # the next forward builds (restores) dense metadata afresh


class DecodeEngine:
    """Admit and prefill requests, decode steps through the coordinator, compare with dense attention."""

    def __init__(self, workload, algorithms: Sequence[str | None] = ("quest",),
                 config: SparseConfig | Sequence[SparseConfig] | None = None, *, dsa_topk: int = 256,
                 page_size: int = 16, max_requests: int = 8, max_context_len: int = 4096, num_pages: int | None = None,
                 backend: str = "auto", compare_dense: bool = True, dtype=torch.float32,
                 bounds_dtype=torch.float32, offload_buffer: int | None = None, device="cpu"):
        algorithms, configs, num_pages, self.device = check_engine(
            workload, algorithms, config, page_size, max_requests, max_context_len, num_pages, compare_dense,
            dsa_topk, device, ALGORITHMS)
        self.workload, self.compare_dense = workload, compare_dense
        self.backend = choose_backend(backend, self.device)  # once, for every layer and stage (sparse_ref.backend)
        # offload mode (sparse_ref.offload): every sparse layer's K/V in host memory, read through a hot buffer
        offloaded = [i for i, a in enumerate(algorithms) if a is not None] if offload_buffer is not None else []
        if offload_buffer is not None and not offloaded:  # (every layer dense: still a size, or a mistake)
            check_int("offload_buffer", offload_buffer, low=1, fix="pass an int, or None (no offload).")
        self.manager = KVCacheManager.create(max_requests=max_requests, max_context_len=max_context_len,
                                             num_pages=num_pages, page_size=page_size, num_layers=len(algorithms),
                                             num_kv_heads=workload.num_kv_heads, head_dim=workload.head_dim,
                                             dtype=dtype, device=self.device, host_layers=offloaded)
        self.coordinator = SparseCoordinator(self.manager, algorithms, configs, workload, dsa_topk, self.device,
                                             bounds_dtype, self.backend)
        self.live: list[Request] = []
        self.plans = {}  # rid -> PlantedRequest
        self.written: dict[int, int] = {}  # rid -> tokens whose K/V this engine wrote (all of them, between steps)
        self.offload = None
        if offloaded:
            from sparse_ref import offload  # lazy: only an offloading engine needs it

            offload.check_offload_backend(offloaded, self.backend)
            coord = self.coordinator
            size = offload.check_offload(offload_buffer, offload.most_tokens_read(
                coord.algorithms, coord.configs, offloaded, dsa_topk, page_size, max_context_len),
                [algorithms[i] for i in offloaded])
            self.offload = offload.OffloadedKV(self.manager.token_to_kv_pool, offloaded, max_requests, size,
                                               max_context_len, self.backend, self.device)

    def attend(self, q: torch.Tensor, layer: int, md: Metadata, kv=None, ready=None) -> torch.Tensor:
        """Paged decode attention of ``q`` over ``md`` with the engine's backend: fp32 ``[bs, H_q, D]``, over the
        layer's K/V buffers (or ``kv``: an offloaded layer's hot buffers, ``ready``: its copies' flags)."""
        pool = self.manager.token_to_kv_pool
        kv = kv or (pool.get_key_buffer(layer), pool.get_value_buffer(layer))
        return self.backend.attention(q, *kv, md.page_table, md.kv_lens, md.page_size, ready=ready)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_len: int, key: int | None = None, needle_depths=None) -> Request:
        """Admit a request of ``prompt_len`` tokens and prefill every layer (K/V, indexer keys, representations)."""
        prompt_len = check_int("prompt_len", prompt_len, low=1, fix="a request needs at least one prompt token.")
        # planned before anything is taken: a prompt the workload cannot build changes nothing
        plan = self.workload.request(self.manager.next_rid if key is None else key, prompt_len, needle_depths)
        req = self.manager.admit(prompt_len)
        try:  # all or nothing: if the prefill fails, the request's row and pages go back
            self.coordinator.on_request_begin(req, prompt_len)
            self._prefill(req, plan, prompt_len)
        except BaseException:
            self.coordinator.prompt_lens.pop(req.req_pool_idx, None)
            self.manager.release(req)
            raise
        self.plans[req.rid], self.written[req.rid] = plan, prompt_len
        self.live.append(req)
        return req

    def _prefill(self, req: Request, plan, prompt_len: int) -> None:
        """Every layer's prompt K/V (and indexer keys) into the pools, then the representations."""
        batch = build_extend_batch(self.manager, [req])
        pool = self.manager.token_to_kv_pool
        for layer in range(pool.num_layers):
            k, v, x = self.workload.prefill(plan, layer, with_hidden=layer in self.coordinator.indexers)
            pool.set_kv(layer, batch.out_cache_loc, k.to(self.device), v.to(self.device))  # (host layers too)
            if layer in self.coordinator.indexers:  # the indexer's prefill pass writes its keys (no scores needed)
                indexer = self.coordinator.indexers[layer]
                qk = indexer.prepare(x.to(self.device), torch.zeros(prompt_len, indexer.config.q_lora_rank,
                                                                    device=self.device), batch.positions)
                indexer.cache.write(layer, batch.out_cache_loc, qk.k, qk.k_scale)
            self.coordinator.attention_end(layer, batch)

    def finish(self, req: Request) -> None:
        """The request leaves: its pages and row are freed (Quest bounds and indexer keys with them)."""
        check_finish(self, req)  # a live request of this engine (by identity), before anything changes
        self.coordinator.on_request_end(req)
        self.live = [r for r in self.live if r is not req]
        del self.plans[req.rid], self.written[req.rid]
        self.manager.release(req)
        if self.offload is not None:
            self.offload.forget(req.req_pool_idx)  # the row's next request starts with an empty hot buffer

    # ---------------------------------------------------------------- one decode step
    def decode_inputs(self, layer: int):
        """The layer's decode inputs for every live request: ``(q, k, v, x, q_lora)`` (x, q_lora: DSA only)."""
        dsa = layer in self.coordinator.indexers
        per_req = [self.workload.decode(self.plans[r.rid], layer, r.seq_len - 1, dsa) for r in self.live]
        q, k, v, x, q_lora = zip(*per_req, strict=True)
        joined = [torch.cat(t).to(self.device) if dsa else None for t in (x, q_lora)]
        return (torch.stack(q).to(self.device), torch.cat(k).to(self.device), torch.cat(v).to(self.device), *joined)

    def _sync(self) -> float:
        torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None
        return time.perf_counter()

    def forward(self, batch: ForwardBatch, inputs) -> tuple[list[LayerTrace], Metadata]:
        """The device half of a decode step, every layer through the coordinator's hooks: ``(traces, dense)``.

        Per layer: the new token's K/V into the pool (before attention reads it) -> ``attention_begin``
        -> attention -> ``attention_end``. No host sync here, and no host bookkeeping but the count of tokens
        written (``mark_written``, Python ints), so ``sparse_ref.engine_graph`` can capture exactly this in one
        CUDA graph (its replays mark the tokens themselves).
        """
        check_engine_forward(self, batch, inputs)  # the live requests' batch now: once per batch, before any write
        coord, pool, traces = self.coordinator, self.manager.token_to_kv_pool, []
        with values_checked():  # its values are checked: the layers' entry points read nothing back (no host sync)
            coord.forward_begin(batch)
            dense = coord.dense
            for layer, (q, k, v, x, q_lora) in enumerate(inputs):
                off = self.offload if self.offload is not None and layer in self.offload.layers else None
                if off is None:  # (an offloaded layer's swap-in writes it into the host pool itself)
                    pool.set_kv(layer, batch.out_cache_loc, k, v)
                md = coord.attention_begin(layer, q, batch, x=x, q_lora=q_lora)
                hot = off.read(layer, batch, md, k, v, self.manager.req_to_token_pool.req_to_token) if off else None
                out = self.attend(q, layer, hot, off.buffers(layer), off.ready) if off else self.attend(q, layer, md)
                traces.append(LayerTrace(layer, coord.name(layer), md, out, offload=hot))
                coord.attention_end(layer, batch)
            coord.forward_end(batch)
        self.mark_written()
        return traces, dense

    def mark_written(self) -> None:
        """Every live request's K/V is written up to its length (``forward`` and a graph replay call this)."""
        for r in self.live:
            self.written[r.rid] = r.seq_len

    def step(self) -> StepResult:
        """Decode one token for every live request: host bookkeeping, then ``forward``, then the dense oracle."""
        check_engine_step(self)  # every live request as the engine left it, before anything grows
        batch = decode_step(self.manager, self.live)  # each request grows by a token (a fresh page when one fills)
        inputs = [self.decode_inputs(layer) for layer in range(self.manager.token_to_kv_pool.num_layers)]
        hot = self.offload.hot if self.offload is not None else None
        hits, misses = (hot.hits, hot.misses) if hot is not None else (0, 0)
        t0 = self._sync()
        traces, dense = self.forward(batch, inputs)
        t1 = self._sync()
        result = StepResult([r.rid for r in self.live], batch.seq_lens.clone(), traces, sparse_time_s=t1 - t0)
        if hot is not None:
            result.offload_hits, result.offload_misses = hot.hits - hits, hot.misses - misses
        if self.compare_dense:
            for trace, (q, *_) in zip(traces, inputs, strict=True):  # dense timing: the device-resident layers
                if trace.layer not in self.manager.token_to_kv_pool.host_layers or self.device.type == "cpu":
                    self.attend(q, trace.layer, dense)
            result.dense_time_s = self._sync() - t1
            from sparse_ref.metrics import compare_with_dense  # lazy: a tutorial helper

            for trace, (q, *_) in zip(traces, inputs, strict=True):
                compare_with_dense(trace, q, batch, self.manager)
        return result


# ------------------------------ argument checks (each entry point above calls one first)
def check_engine(workload, algorithms, config, page_size, max_requests, max_context_len, num_pages, compare_dense,
                 dsa_topk, device, known_algorithms):
    """``(algorithms, configs, num_pages, device)`` of a ``DecodeEngine``: one algorithm and config per layer."""
    needs = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "request", "prefill", "decode", "indexer")
    if not all(hasattr(workload, n) for n in needs):
        fail("workload", "a PlantedEngineWorkload (or an object with its attributes, as "
             "tensor_parallel.RankWorkload)", describe(workload), error=ConfigError)
    algorithms = list(algorithms)
    if len(algorithms) != workload.num_layers or any(name not in known_algorithms for name in algorithms):
        raise ConfigError(f"algorithms: expected one entry per workload layer ({workload.num_layers}), each entry "
                          f"must be one of {known_algorithms}; got {algorithms}. Fix: e.g. ['quest', None, ...].")
    configs = list(config) if isinstance(config, (list, tuple)) else [config or SparseConfig()] * len(algorithms)
    if len(configs) != len(algorithms):
        raise ConfigError(f"config: expected one SparseConfig, or one per layer ({len(algorithms)}), got "
                          f"{len(configs)}.")
    for name, value, low in (("page_size", page_size, 1), ("max_requests", max_requests, 1),
                             ("max_context_len", max_context_len, 1), ("dsa_topk", dsa_topk, 1)):
        check_int(name, value, low=low)
    if num_pages is None:
        num_pages = max_requests * -(-max_context_len // page_size) + 1
    num_pages = check_int("num_pages", num_pages, low=2, fix="leave num_pages=None: enough pages for every request "
                          "at max_context_len (page 0 is padding).")
    if not isinstance(compare_dense, bool):
        fail("compare_dense", "True or False", describe(compare_dense), error=ConfigError)
    return algorithms, configs, num_pages, check_device("device", device)


def check_finish(engine, req) -> None:
    """``req`` is one of the engine's live requests, by identity (an equal request of another engine is not)."""
    if not any(r is req for r in engine.live) or engine.manager.requests.get(getattr(req, "rid", None)) is not req:
        raise PoolError(f"finish: expected a live request of this engine, got {req!r} (finished already, never "
                        "added, or another engine's). Fix: call finish once per request its add_request returned.")


def check_request_begin(coordinator, req, prompt_len) -> None:
    check_request("on_request_begin(req)", req)
    check_int("on_request_begin(prompt_len)", prompt_len, low=0, error=PoolError)
    if req.req_pool_idx in coordinator.prompt_lens:
        raise PoolError(f"on_request_begin: the request in req_to_token row {req.req_pool_idx} has begun already "
                        "(each request begins once). Fix: call on_request_end first, once it finishes.")


def check_request_end(coordinator, req) -> None:
    check_request("on_request_end(req)", req)
    if req.req_pool_idx not in coordinator.prompt_lens:
        raise PoolError(f"on_request_end: no request in req_to_token row {req.req_pool_idx} has begun (ended "
                        "already, or never begun). Fix: call on_request_begin and on_request_end once each.")


def check_coordinator_layer(coordinator, layer) -> int:
    """A layer of the engine, ``[0, num_layers)`` (``-1`` is refused: it would wrap to the last layer)."""
    return check_int("layer", layer, low=0, high=len(coordinator.algorithms) - 1, error=PoolError,
                     fix=f"the engine has layers [0, {len(coordinator.algorithms)}).")


def check_engine_forward(engine, batch, inputs) -> None:
    """Eager: ``batch`` is the DECODE batch of the live requests as they are now; ``inputs`` one entry per layer."""
    if not isinstance(batch, ForwardBatch) or batch.forward_mode is not ForwardMode.DECODE:
        fail("batch", "a DECODE ForwardBatch (decode_step)", describe(batch), error=BatchError)
    layers = engine.manager.token_to_kv_pool.num_layers
    if not isinstance(inputs, (list, tuple)) or len(inputs) != layers:
        fail("inputs", f"one (q, k, v, x, q_lora) per layer ({layers})", describe(inputs), error=BatchError)
    for r in engine.live:  # host-side: each request one token past what the engine wrote (its decode token), or
        written = engine.written[r.rid]  # the step it wrote last, again (a replay writes the same token again)
        if r.seq_len not in (written, written + 1):
            fail("batch", f"one new token per request past the tokens whose K/V the engine wrote (request {r.rid}: "
                 f"{written + 1})", f"request {r.rid} at seq_len {r.seq_len}",
                 "grow requests only through engine.step() (or decode_step once per forward): tokens grown "
                 "outside it have no K/V here, and a reused page still holds its previous owner's.", BatchError)
    if capturing() or batch.is_current(engine.manager, engine.live):  # decode_step's batch of the live requests now
        return
    if batch.built_from is not None and batch.built_from[0] is engine.manager and \
            batch.built_from[1] != engine.manager.generation:
        fail("batch", f"the batch of the live requests now (generation {engine.manager.generation})",
             f"one built at generation {batch.built_from[1]} (a request joined, grew or left since)",
             "build it after the last add_request / finish / grow (decode_step), or call engine.step().", BatchError)
    live = engine.live  # a batch built by hand (or edited since): its values, read back once
    rows = torch.tensor([r.req_pool_idx for r in live], dtype=torch.int64)
    seq_lens = torch.tensor([r.seq_len for r in live], dtype=torch.int64)
    if batch.batch_size != len(live) or not torch.equal(batch.req_pool_indices.cpu(), rows) or \
            not torch.equal(batch.seq_lens.cpu(), seq_lens):
        fail("batch", f"the batch of the live requests now (rows {rows.tolist()}, seq_lens {seq_lens.tolist()})",
             f"rows {batch.req_pool_indices.tolist()}, seq_lens {batch.seq_lens.tolist()}",
             "build it after the last add_request / finish / grow (decode_step), or call engine.step().", BatchError)
    check_batch_slots(engine.manager.req_to_token_pool.req_to_token, batch, "batch.")


def check_engine_step(engine) -> None:
    """Before ``decode_step`` grows anything: every live request as the engine left it (K/V written to its length)."""
    for r in engine.live:
        if r.released or r.seq_len != engine.written[r.rid]:
            fail(f"engine.live (request {r.rid})", f"the request as the engine left it: {engine.written[r.rid]} "
                 "tokens, K/V written for all", "released" if r.released else f"seq_len {r.seq_len}",
                 "grow and release requests only through the engine (step, finish); a request changed "
                 "outside it must be finished.", BatchError)
