"""Tensor parallelism: the decode engine with its attention heads split over ``torch.distributed`` ranks.

Rank ``r`` of ``W`` holds KV heads ``[r H_kv / W, (r + 1) H_kv / W)`` and the query heads that read them
(query head ``h`` reads KV head ``h // G``, so a rank's query heads are contiguous too): its slice of the
KV pool and of the Quest bounds. ``req_to_token`` and the page allocator are the same on every rank,
because every rank admits, grows and frees the same requests in the same order (compared before each
call, so a change made on one rank alone is refused on every rank before anything changes). Each rank
computes attention for its own heads; ``step`` gathers them.

Quest, two modes (``quest_mode``):

* ``"per_rank"`` (what SGLang does): each rank scores pages on its own heads and selects alone, with
  no communication. Each rank equals a one-process engine on its own heads; the ranks may keep
  different pages, and neither equals one process over all heads.
* ``"global"``: each rank's scores are its heads' share of the sum over heads that a page score is
  (in both GQA modes), so one all-reduce (``bs x max_pages`` fp32 per layer) before the selection makes
  every rank select what one process selects over all heads, in the same ``gqa_mode``. Exact up to the
  fp32 rounding of the sum: two pages whose one-process scores differ by a few ulps may swap.

DSA (``dsa_mode``): the indexer reads ``x`` and ``q_lora``, which every rank holds whole, so it is
replicated and every rank computes the same logits and top-k. sparse_ref's top-k is deterministic (ties
to the lower id), so the ranks agree bit for bit; ``"check"`` all-gathers a hash of each selection and
refuses a disagreement on every rank (eager only: it reads the hash on the host); ``"broadcast"`` sends
rank 0's selection instead, the fix SGLang adopted when its ranks disagreed (CUDA-graph safe).

Every exchange first agrees on a tag (what, layer, sequence number) across the ranks, eagerly: a rank
that calls the engine out of order makes every rank raise ``BatchError`` instead of pairing the wrong
collectives or hanging. Every public call agrees twice on every rank's outcome: after the checks the call
makes before it changes anything (a refusal on one rank, say pages taken out of band there, is raised on
every rank, naming that rank, and nothing changes anywhere), and after it ran (an error on one rank only,
project error or not, an interrupt too, is raised on every rank; the ranks where it passed kept its changes, so
the engine then refuses every later call: build a new one). A step's own exchanges (global Quest, DSA) have the
outcome exchange's size and layout: a rank that fails before one of them meets the others there with its
outcome, and every rank raises (no rank waits for the timeout, and gloo never pairs collectives of two sizes).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from sparse_ref.batch import check_decode_step
from sparse_ref.checks import capturing, check_choice, check_device, check_int, describe, fail
from sparse_ref.engine import DecodeEngine, StepResult, check_engine_step, check_finish
from sparse_ref.errors import (
    BatchError,
    ConfigError,
    PoolError,
    RankError,
    RetrievalError,
    ShapeError,
    SparseRefError,
    UnknownAlgorithmError,
)
from sparse_ref.memory import check_admit
from sparse_ref.workloads import PlantedEngineWorkload

QUEST_MODES = ("per_rank", "global")
DSA_MODES = ("check", "broadcast")
_KINDS = {"config": 1, "pools": 2, "scores": 3, "selection": 4, "outputs": 5}
_ERRORS = {"config": ConfigError, "pools": PoolError, "selection": RetrievalError}
_CALLS = {"init": 1, "add_request": 2, "finish": 3, "step": 4}
_IN_EXCHANGE = 1 << 62  # above any settings hash (>> 2): an outcome exchange met a step's own exchange
_OUTCOMES = (ConfigError, PoolError, BatchError, RetrievalError, ShapeError, UnknownAlgorithmError, SparseRefError)


def outcome_code(error: BaseException | None) -> int:
    """0: the call passed; 1 + the index of its class in ``_OUTCOMES``: a project error; past them: any other."""
    if error is None:
        return 0
    return next((i + 1 for i, cls in enumerate(_OUTCOMES) if isinstance(error, cls)), len(_OUTCOMES) + 1)


def attempt(fn):
    """``(error, value)`` of ``fn()``: what it raised (an interrupt too), or None and its value."""
    try:
        return None, fn()
    except BaseException as e:  # noqa: BLE001 (every rank must learn this rank's outcome before it raises)
        return e, None


class RankWorkload:
    """This rank's heads of a ``PlantedEngineWorkload``: the same numbers, sliced after they are made."""

    def __init__(self, workload, rank: int, world: int):
        self.full = workload
        self.num_layers, self.head_dim, self.indexer_config = workload.num_layers, workload.head_dim, \
            workload.indexer_config
        self.num_kv_heads, self.num_q_heads = workload.num_kv_heads // world, workload.num_q_heads // world
        self.kv = slice(rank * self.num_kv_heads, (rank + 1) * self.num_kv_heads)
        self.q = slice(rank * self.num_q_heads, (rank + 1) * self.num_q_heads)

    def request(self, key, prompt_len, needle_depths=None):
        return self.full.request(key, prompt_len, needle_depths)

    def indexer(self, layer, index_topk=None, device="cpu", backend="auto"):
        return self.full.indexer(layer, index_topk, device, backend)  # replicated: the same weights on every rank

    def prefill(self, req, layer, with_hidden=True):
        k, v, x = self.full.prefill(req, layer, with_hidden)
        return k[:, self.kv], v[:, self.kv], x

    def decode(self, req, layer, position, with_hidden=True):
        q, k, v, x, q_lora = self.full.decode(req, layer, position, with_hidden)
        return q[self.q], k[:, self.kv], v[:, self.kv], x, q_lora


_MIX = (0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """An int64 0-d hash of an integer tensor's values and their order: each (position, value) pair goes through
    a non-linear mix (splitmix64's multiply and shift-xor steps, wrapping), then the mixes are summed. A weighted
    sum would not do: two values that move by amounts its weights cancel (``[0, 5, 9]`` against ``[3, 4, 9]``
    under weights 1, 3, 5) would hash equal."""
    v = t.reshape(-1).long()
    x = v * _MIX[0] + torch.arange(v.numel(), device=v.device)
    x = (x ^ (x >> 30)) * _MIX[1]
    x = (x ^ (x >> 27)) * _MIX[2]
    return (x ^ (x >> 31)).sum()


class RankGroup:
    """This rank's exchanges with the others. Each agrees on a tag first (eagerly), then runs."""

    def __init__(self, group=None):
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0) if group is not None else 0
        self.calls, self.failed = 0, []  # failed: the ranks the last call failed on
        self.stats: dict[str, list] = {}  # what -> [exchanges, bytes sent per rank, host seconds] (eager calls)

    def _count(self, what: str, t: torch.Tensor, start: float) -> None:
        entry = self.stats.setdefault(what, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += t.numel() * t.element_size()
        entry[2] += time.perf_counter() - start  # CPU (gloo): the exchange; CUDA (NCCL): its launch only

    def begin(self, call: str, args, device, error: Exception | None = None, ran: bool = False) -> None:
        """One exchange: every rank makes the same call (its name and sequence number), with the same arguments (a
        hash), and every rank's outcome (``error``: this rank's, or None). Returns when every rank passed; else
        every rank raises: ``BatchError`` when the ranks are out of step or pass other arguments; else this rank
        its own error (a ``RankError`` when it is not a project error), the others the failing rank's error
        class, naming that rank.
        ``ran``: the call has run (``self.failed`` then says which ranks it failed on)."""
        self.calls += 1
        tag, h = self.calls * 16 + _CALLS[call], int(settings_hash(call, args)) >> 2  # (>> 2: -h fits int64)
        codes = [outcome_code(error) if r == self.rank else 0 for r in range(self.world)]
        v = torch.tensor([tag, -tag, h, -h, *codes], dtype=torch.int64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
        codes = v[4:].tolist()
        self.failed = [r for r, code in enumerate(codes) if code]
        kept = 0 < len(self.failed) < self.world and ran
        after = ("; the ranks where it passed kept its changes, so the engine refuses every later call. Fix: build "
                 "a new engine on every rank" if kept else "" if ran else ", with nothing changed. Fix: make the "
                 "call valid on every rank")
        in_exchange = int(v[2]) == int(v[3]) == _IN_EXCHANGE  # the others wait in a step's exchange: this rank failed
        if not in_exchange and int(v[0]) != -int(v[1]):
            raise BatchError(f"tensor parallel: rank {self.rank} calls {call} (call {self.calls}) but another rank "
                             "calls something else: the ranks are out of step; nothing was changed. Fix: call "
                             "add_request, finish and step in the same order on every rank.")
        if not in_exchange and int(v[2]) != -int(v[3]):
            raise BatchError(f"tensor parallel: the ranks call {call} with different arguments (rank {self.rank}: "
                             f"{args!r}); nothing was changed. Fix: pass the same prompt, key, needles and "
                             "requests on every rank (as torchrun runs one script).")
        if isinstance(error, SparseRefError) or (error is not None and not isinstance(error, Exception)):
            raise error  # (an interrupt stays an interrupt on its own rank)
        if error is not None:
            raise RankError(f"tensor parallel: {call} failed on rank {self.rank} with {type(error).__name__}: "
                            f"{error}; every rank stops{after}.") from error
        if self.failed:
            raise self.peer_failed(codes, call, after)

    def peer_failed(self, codes: list[int], call: str, after: str) -> SparseRefError:
        """The error this rank raises for the first rank that failed (its class where it is a project error)."""
        code = codes[self.failed[0]]
        cls = _OUTCOMES[code - 1] if code <= len(_OUTCOMES) else RankError
        error = cls(f"tensor parallel: rank {self.failed[0]} {'failed in' if cls is RankError else 'refused'} its "
                    f"{call} (its own error says why); rank {self.rank} stops too{after}.")
        error.outcome_exchanged = True  # every rank has heard: no outcome exchange follows
        return error

    def _agree(self, what: str, layer: int, device) -> None:
        """Every rank is at the same exchange (what, layer, how many before it); else all raise BatchError. Laid
        out as ``begin``'s exchange: a rank that failed before this exchange meets the others here with its
        outcome, and every rank raises its error (``peer_failed``)."""
        self.calls += 1
        if capturing():
            return
        tag = (self.calls * 4096 + layer + 1) * 8 + _KINDS[what]
        t = torch.zeros(4 + self.world, dtype=torch.int64, device=device)
        t[0], t[1], t[2], t[3] = tag, -tag, _IN_EXCHANGE, _IN_EXCHANGE
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        codes = t[4:].tolist()
        self.failed = [r for r, code in enumerate(codes) if code]
        if self.failed:
            raise self.peer_failed(codes, "step", "; the ranks where it passed kept its changes, so the engine "
                                   "refuses every later call. Fix: build a new engine on every rank")
        if int(t[0]) != -int(t[1]):
            raise BatchError(f"tensor parallel: rank {self.rank} is at exchange {self.calls} ({what}, layer {layer}) "
                             "but another rank is not: the ranks are out of step. Fix: call add_request, finish "
                             "and step (and any hook) in the same order, with the same arguments, on every rank.")

    def same_everywhere(self, what: str, value: torch.Tensor, layer: int = -1, detail: str = "",
                        parts: Sequence[str] = ()) -> None:
        """Refuse, on every rank, unless ``value`` (int64, 0-d or ``[n]``) is equal on every rank; ``parts`` names
        each entry (the message says which differ). Eager."""
        self._agree(what, layer, value.device)
        if capturing():
            return
        value = value.reshape(-1).to(torch.int64)
        both, start, n = torch.cat([value, -value]), time.perf_counter(), value.numel()
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        self._count(what, both, start)
        differ = [i for i in range(n) if int(both[i]) != -int(both[n + i])]
        if differ:
            noun = {"config": "settings", "pools": "pools", "selection": "selections"}[what]
            names = f" ({', '.join(parts[i] for i in differ)})" if parts else ""
            raise _ERRORS[what](f"tensor parallel: the ranks' {noun} differ{names}{detail}. Fix: " + {
                "config": "launch every rank with the same workload, algorithms, config and modes.",
                "pools": "admit and finish the same requests in the same order, through this engine, on every rank "
                         "(a change made on one rank alone stays: build a new engine on every rank).",
                "selection": "select with a deterministic top-k (ties to the lower id, as sparse_ref's), or "
                             "use dsa_mode='broadcast' to send rank 0's selection."}[what])

    def all_reduce_sum(self, t: torch.Tensor, what: str, layer: int) -> torch.Tensor:
        self._agree(what, layer, t.device)
        start = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._count(what, t, start)
        return t

    def broadcast(self, t: torch.Tensor, what: str, layer: int) -> torch.Tensor:
        self._agree(what, layer, t.device)
        start = time.perf_counter()
        dist.broadcast(t, src=self.root, group=self.group)
        self._count(what, t, start)
        return t

    def gather_heads(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """``[bs, H_q / W, D]`` from every rank -> ``[bs, H_q, D]`` (rank order is head order)."""
        self._agree("outputs", layer, t.device)
        parts, start = [torch.empty_like(t) for _ in range(self.world)], time.perf_counter()
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self._count("outputs", t, start)
        return torch.cat(parts, dim=1)


def settings_hash(*settings) -> torch.Tensor:
    """An int64 hash of the settings' reprs (workloads and configs are dataclasses: their repr is their value)."""
    digest = hashlib.sha256(repr(settings).encode()).digest()
    return torch.tensor(int.from_bytes(digest[:8], "little", signed=True))


class TensorParallelEngine:
    """``DecodeEngine`` on this rank's heads, with Quest's all-reduce and DSA's agreement (module docstring).

    Call every method in the same order with the same arguments on every rank (as ``torchrun`` runs one
    script per rank). ``step()`` returns this rank's ``StepResult`` (its heads; recall and mass kept
    against its own dense attention) and the gathered outputs of every layer, ``[bs, H_q, D]``.
    """

    def __init__(self, workload, algorithms: Sequence[str | None] = ("quest",), config=None, *,
                 quest_mode: str = "global", dsa_mode: str = "check", group=None, **engine_kwargs):
        check_distributed()  # (without a process group no rank can tell the others anything)
        error, device = None, None
        try:  # this rank's own checks; the ranks then agree, so a setting one rank refuses stops every rank
            device = check_tensor_parallel(workload, quest_mode, dsa_mode, group, engine_kwargs.get("device", "cpu"),
                                           QUEST_MODES, DSA_MODES)
        except SparseRefError as e:
            error = e
        self.comm, self.quest_mode, self.dsa_mode = RankGroup(group), quest_mode, dsa_mode
        exchange = device or torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        shared = {k: v for k, v in engine_kwargs.items() if k != "device"}  # (each rank has its own GPU)
        self.comm.begin("init", None, exchange, error)
        self.comm.same_everywhere("config", settings_hash(workload, list(algorithms), config, quest_mode, dsa_mode,
                                                          sorted(shared.items(), key=str)).to(device))
        error, engine = attempt(lambda: DecodeEngine(RankWorkload(workload, self.comm.rank, self.comm.world),
                                                     algorithms, config, **engine_kwargs))  # its own checks too
        self.comm.begin("init", "engine", device, error)
        self.engine, self.device, self.broken = engine, device, None
        for algo in self.engine.coordinator.algorithms:  # the two exchanges, wrapped around the algorithms
            if algo is not None and algo.name == "quest" and quest_mode == "global":
                algo.score_pages = self._summed_over_ranks(algo.score_pages)
            elif algo is not None and algo.name == "deepseek_dsa":
                algo.retrieve_topk = self._agreed(algo.retrieve_topk)

    def _summed_over_ranks(self, own_scores):
        def score_pages(queries, layer_id, req_pool_indices, forward_batch):
            scores = own_scores(queries, layer_id, req_pool_indices, forward_batch)  # this rank's heads' share
            return self.comm.all_reduce_sum(scores.contiguous(), "scores", layer_id)  # the sum over all heads
        return score_pages

    def _agreed(self, own_selection):
        def retrieve_topk(queries, layer_id, *args, **kwargs):
            selected, lengths = own_selection(queries, layer_id, *args, **kwargs)
            if self.dsa_mode == "broadcast":
                self.comm.broadcast(selected, "selection", layer_id)
            else:
                self.comm.same_everywhere("selection", tensor_hash(selected), layer_id,
                                          f" at layer {layer_id} (DSA, replicated indexer)")
            return selected, lengths
        return retrieve_topk

    # ------------------------------------------------------------------ the engine's calls, on every rank
    @property
    def live(self):
        return self.engine.live

    def _check_pools(self, call: str) -> None:
        """Before every call: req_to_token, the free pages and the next request id are the same on every rank (each
        admits and frees the same requests in the same order); a change made on one rank alone is refused on every
        rank before anything changes."""
        m = self.engine.manager
        r2t = m.req_to_token_pool.req_to_token
        value = torch.tensor([0, m.allocator.available_pages(), m.next_rid], device=r2t.device)
        value[0] = tensor_hash(r2t)
        self.comm.same_everywhere("pools", value, detail=f" before {call}; nothing was changed",
                                  parts=("req_to_token", "the free pages", "the next request id"))

    def _on_every_rank(self, call: str, args, check, apply):
        """``apply()`` on every rank, after every rank agreed on the call, its arguments and the outcome of its
        ``check()`` (what the call checks before it changes anything); then every rank learns every rank's outcome.
        Each ``DecodeEngine`` call is all or nothing on its rank: a call that failed on some ranks only leaves the
        ranks apart, so the engine refuses every later call (``broken``)."""
        if self.broken is not None:
            raise RankError(f"tensor parallel: this engine is unusable: {self.broken}. Fix: build a new "
                            "TensorParallelEngine on every rank.")
        self._check_pools(call)
        self.comm.begin(call, args, self.device, attempt(check)[0])
        error, value = attempt(apply)
        if getattr(error, "outcome_exchanged", False):  # another rank's failure, heard inside one of the step's
            self.broken = f"{call} failed on rank {self.comm.failed[0]} only"  # exchanges: every rank knows
            raise error
        try:
            self.comm.begin(call, "done", self.device, error, ran=True)
        except BaseException:  # (a project error, or this rank's own interrupt raised again)
            if 0 < len(self.comm.failed) < self.comm.world:
                self.broken = f"{call} failed on rank {self.comm.failed[0]} only"
            raise
        return value

    def add_request(self, prompt_len: int, key: int | None = None, needle_depths=None):
        e = self.engine
        args = (prompt_len, key, None if needle_depths is None else list(needle_depths), e.manager.next_rid)

        def check():  # DecodeEngine.add_request's checks, before it changes anything
            n = check_int("prompt_len", prompt_len, low=1, fix="a request needs at least one prompt token.")
            e.workload.request(e.manager.next_rid if key is None else key, n, needle_depths)
            check_admit(e.manager, n)

        return self._on_every_rank("add_request", args, check, lambda: e.add_request(prompt_len, key, needle_depths))

    def finish(self, req) -> None:
        self._on_every_rank("finish", (getattr(req, "rid", None), getattr(req, "req_pool_idx", None)),
                            lambda: check_finish(self.engine, req), lambda: self.engine.finish(req))

    def step(self) -> tuple[StepResult, list[torch.Tensor]]:
        """One decode step on every rank: this rank's result, and each layer's output over all heads."""
        e = self.engine
        result = self._on_every_rank("step", [(r.rid, r.seq_len) for r in e.live],
                                     lambda: (check_engine_step(e), check_decode_step(e.manager, e.live)), e.step)
        return result, [self.comm.gather_heads(t.out, t.layer) for t in result.layers]


# ------------------------------ argument checks (each entry point above calls one first)
def check_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("tensor parallel: torch.distributed is not initialised. Fix: launch with torchrun "
                          "(torchrun --nproc-per-node 2 ...) and call torch.distributed.init_process_group first.")


def check_tensor_parallel(workload, quest_mode, dsa_mode, group, device, quest_modes, dsa_modes) -> torch.device:
    """This rank's checks of a ``TensorParallelEngine``'s settings (the ranks then agree on the outcome)."""
    if not isinstance(workload, PlantedEngineWorkload):
        fail("workload", "a PlantedEngineWorkload", describe(workload), error=ConfigError)
    check_choice("quest_mode", quest_mode, quest_modes)
    check_choice("dsa_mode", dsa_mode, dsa_modes)
    world = dist.get_world_size(group)
    if workload.num_kv_heads % world:
        fail("workload.num_kv_heads", f"a multiple of the world size {world} (each rank holds whole KV heads)",
             str(workload.num_kv_heads), "choose a world size that divides the KV heads.", ConfigError)
    dev = check_device("device", device)
    check_tp_backend(dist.get_backend(group), dev)
    return dev


def check_tp_backend(backend: str, device: torch.device) -> None:
    """NCCL moves CUDA tensors, gloo CPU tensors: the process group's backend must fit the engine's device."""
    want = "nccl" if device.type == "cuda" else "gloo"
    if backend != want:
        fail("backend", f"'{want}' for an engine on {device.type}", repr(backend),
             f"init_process_group('{want}'), or put the engine on "
             f"{'cpu' if backend == 'gloo' else 'cuda (one GPU per rank)'}.", ConfigError)
