"""Tensor parallelism under torch.distributed: 2 processes, gloo, on CPU (sparse_ref.tensor_parallel).

Each test starts the ranks (tests/tp_scenarios.py) with a 30 s timeout on every collective and a
deadline on the whole run, so a broken exchange fails the test instead of hanging it.
"""

import pytest
import torch
import torch.distributed as dist
import tp_scenarios

from sparse_ref.errors import ConfigError
from sparse_ref.tensor_parallel import check_tp_backend

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def values(results):
    assert all(status == "ok" for status, _ in results.values()), results
    return [value for _, value in results.values()]


@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_global_quest_and_dsa_equal_one_process_over_every_step(gqa_mode):
    """Quest with its scores summed over the ranks, and the replicated DSA indexer (hash-checked), select
    exactly what one process selects over all heads, through joins and leaves; the gathered outputs equal it."""
    for summary in values(tp_scenarios.run_ranks(tp_scenarios.equality, "global", "check", gqa_mode)):
        assert summary["steps"] == 11 and summary["sparse_rows"] > 10, summary
        assert summary["differs_from_one"] == 0 and summary["max_err"] < 1e-5, summary


def test_per_rank_quest_equals_one_process_on_its_own_heads_and_broadcast_dsa_equals_one_process():
    summaries = values(tp_scenarios.run_ranks(tp_scenarios.equality, "per_rank", "broadcast", "per_kv_head",
                                                    (0, 3)))
    assert all(s["steps"] == 11 for s in summaries)
    assert sum(s["differs_from_one"] for s in summaries) > 0, "per-rank selections are not one process's"


def test_bad_set_ups_raise_on_every_rank_and_never_hang():
    ranks = values(tp_scenarios.run_ranks(tp_scenarios.refusals))
    for name, error in (("heads", "ConfigError: workload.num_kv_heads"), ("config", "ConfigError: tensor parallel"),
                        ("mode", "ConfigError: quest_mode"), ("order", "BatchError: tensor parallel")):
        assert all(r[name].startswith(error) for r in ranks), (name, [r[name] for r in ranks])


def test_ranks_that_break_ties_differently_are_caught_and_broadcast_makes_them_agree():
    caught = tp_scenarios.run_ranks(tp_scenarios.disagreement, "check")
    assert [status for status, _ in caught.values()] == ["RetrievalError"] * 2, caught
    assert all("the ranks' selections differ at layer 1" in message for _, message in caught.values())
    agreed = values(tp_scenarios.run_ranks(tp_scenarios.disagreement, "broadcast"))
    assert agreed[0] == agreed[1]


def test_the_backend_must_fit_the_device():
    check_tp_backend("gloo", torch.device("cpu"))
    check_tp_backend("nccl", torch.device("cuda"))
    for backend, device in (("nccl", "cpu"), ("gloo", "cuda"), ("mpi", "cpu")):
        with pytest.raises(ConfigError, match="backend"):
            check_tp_backend(backend, torch.device(device))


def test_refused_without_an_initialised_process_group():
    from sparse_ref.tensor_parallel import TensorParallelEngine

    with pytest.raises(ConfigError, match="torchrun"):
        TensorParallelEngine(tp_scenarios.workload(), tp_scenarios.LAYERS, tp_scenarios.config())


def test_the_demo_refuses_tp_without_torchrun(capsys):
    from sparse_ref import demo

    assert demo.main(["--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tp" in err and "torchrun --standalone --nproc-per-node 2" in err


def test_a_call_one_rank_makes_differently_is_refused_on_every_rank_before_anything_changes():
    """A setting only one rank refuses, different keys, needles or prompts, a prompt too long on one rank, and
    step on one rank against finish on the other: every rank raises a project error (none waits for a timeout),
    no state changes, and the ranks go on together."""
    results = tp_scenarios.run_ranks(tp_scenarios.agreement)
    values(results)
    ranks = [results[rank][1] for rank in sorted(results)]  # in rank order
    assert ranks[0]["mode on one rank"].startswith("ConfigError: tensor parallel: rank 1 refused its init")
    assert ranks[1]["mode on one rank"].startswith("ConfigError: quest_mode")
    for name in ("key", "needles", "prompt", "too long on one rank", "step against finish"):
        assert all(r[name].startswith("BatchError: tensor parallel") for r in ranks), (name, ranks)
    for r in ranks:
        assert r["key state"] == r["needles state"] == r["prompt state"] == r["too long on one rank state"] == []
        assert r["step against finish state"] == [(0, 21)]  # neither stepped nor finished (refused adds took no rid)
        assert r["after"] == "ok" and r["after state"] == [(0, 22)]
    assert ranks[0]["after state"] == ranks[1]["after state"]


def test_a_call_that_fails_on_one_rank_only_raises_on_every_rank_naming_it():
    """Same arguments, one rank apart: pages taken out of band there are found before the call (the pools compared,
    nothing changes anywhere, the ranks go on once they match); a refusal of one rank's checks is raised on every
    rank naming it; an error that is not a project error on every rank is rolled back everywhere (the engine goes
    on); on one rank only (out of memory), every rank raises a RankError naming rank 1 at once (no collective
    timeout), and the engine, now apart, refuses later calls."""
    results = tp_scenarios.run_ranks(tp_scenarios.outcomes, timeout=90)
    ranks = [r for _, r in (results[rank] for rank in sorted(results))]
    assert all(status == "ok" for status, _ in results.values()), results
    for name in ("add, pages out of band", "step, pages out of band"):
        call = "add_request" if name.startswith("add") else "step"
        assert all(r[name].startswith("PoolError: tensor parallel: the ranks' pools differ (the free pages) before "
                                      f"{call}; nothing was changed") for r in ranks), (name, ranks)
        assert ranks[0][name + " state"] == ranks[1][name + " state"] == [(0, 20)]
    assert ranks[0]["step after"] == ranks[1]["step after"] == "ok"
    assert ranks[0]["step after state"] == ranks[1]["step after state"] == [(0, 21)]
    name = "add, refused on rank 1"
    assert ranks[1][name] == "PoolError: no room on this rank (simulated)", ranks[1][name]
    assert ranks[0][name].startswith("PoolError: tensor parallel: rank 1 refused its add_request"), ranks[0][name]
    assert "with nothing changed" in ranks[0][name] and ranks[0][name + " state"] == ranks[1][name + " state"]
    for rank, r in enumerate(ranks):
        assert r["add, out of memory everywhere"].startswith(f"RankError: tensor parallel: add_request failed on "
                                                             f"rank {rank} with RuntimeError"), r
        assert "refuses every later call" not in r["add, out of memory everywhere"]
        assert r["add, out of memory everywhere state"] == [(0, 21)]  # rolled back on every rank
        assert r["after the add failed everywhere"] == "ok" and r["after the add failed everywhere state"] == [(0, 22)]
    for name, call in (("add, out of memory", "add_request"), ("step, out of memory", "step")):
        assert ranks[1][name].startswith(f"RankError: tensor parallel: {call} failed on rank 1 with RuntimeError: "
                                         "CUDA out of memory (simulated)"), ranks[1][name]
        assert ranks[0][name].startswith(f"RankError: tensor parallel: rank 1 failed in its {call}"), ranks[0][name]
        assert all("refuses every later call" in r[name] for r in ranks)
    assert ranks[0]["add, out of memory state"] == [(0, 22), (2, 9)]  # rank 0 admitted it, rank 1 rolled back
    # (rid 1 went to the request that failed everywhere: a rid is never given twice)
    assert ranks[1]["add, out of memory state"] == [(0, 22)]
    for name in ("after the failed add", "after the failed step"):
        assert all(r[name].startswith("RankError: tensor parallel: this engine is unusable") for r in ranks), name
    assert ranks[0]["after the failed add state"] == ranks[0]["add, out of memory state"]  # nothing more ran


@pytest.mark.parametrize("world, layers, kind", [(2, ["quest", None, None], "oom"),
                                                (3, ["deepseek_dsa", None, None], "oom"),
                                                (2, ["quest", "deepseek_dsa", None], "interrupt")])
def test_a_rank_failing_before_a_steps_exchange_stops_every_rank(world, layers, kind):
    """Rank 1 fails inside step() before the step's first exchange while the others wait in it: the exchange and
    the failing rank's outcome exchange have one size, so gloo pairs them (it once aborted the waiting process
    with collectives of two sizes): every rank raises at once, the failing one its own error (an interrupt stays
    an interrupt), the others a RankError naming it, and the engine refuses later calls."""
    results = tp_scenarios.run_ranks(tp_scenarios.failure_in_step, layers, kind, world=world, timeout=90)
    assert all(status == "ok" for status, _ in results.values()), results  # no rank aborted, none hung
    ranks = [value for _, value in (results[rank] for rank in sorted(results))]
    own = "KeyboardInterrupt" if kind == "interrupt" else "RankError: tensor parallel: step failed on rank 1 with " \
        "RuntimeError: CUDA out of memory (simulated)"
    assert ranks[1]["step"].startswith(own), ranks[1]
    for rank in (0, *range(2, world)):
        assert ranks[rank]["step"].startswith("RankError: tensor parallel: rank 1 failed in its step"), ranks[rank]
    assert all(r["after"].startswith("RankError: tensor parallel: this engine is unusable") for r in ranks), ranks


def test_changes_made_outside_the_engine_on_one_rank_are_caught_on_every_rank():
    """The exchange's kind is in its tag; the pools (req_to_token, the free pages, the next request id) are compared
    before every call, so a change one rank made alone is refused on every rank, named, before anything changes."""
    ranks = values(tp_scenarios.run_ranks(tp_scenarios.out_of_band, timeout=90))
    pools = "PoolError: tensor parallel: the ranks' pools differ"
    for r in ranks:
        assert r["kind"].startswith("BatchError: tensor parallel: rank "), r["kind"]
        assert "(scores, layer 0)" in r["kind"] or "(selection, layer 0)" in r["kind"], r["kind"]
        assert r["join"].startswith(f"{pools} (the free pages) before add_request; nothing was changed"), r["join"]
        assert r["after the join"].startswith(f"{pools} (the free pages) before step"), r["after the join"]
        assert r["join state"] == r["after the join state"] == []  # nothing admitted on either rank
        assert r["admitted on one rank"].startswith(f"{pools} (req_to_token, the free pages, the next request id) "
                                                    "before add_request"), r["admitted on one rank"]
        assert r["leave"].startswith(f"{pools} (the free pages) before finish"), r["leave"]
        assert r["step, other live"].startswith(f"{pools} (req_to_token, the free pages) before step"), r
        assert r["step, other lengths"].startswith(f"{pools} (req_to_token") and "before step" in \
            r["step, other lengths"], r


def test_the_exchange_tag_includes_the_layer():
    ranks = values(tp_scenarios.run_ranks(tp_scenarios.layer_tag))
    assert all(r.startswith("BatchError: tensor parallel") for r in ranks), ranks


def test_global_scores_are_the_sum_over_the_ranks():
    for diff, scale in values(tp_scenarios.run_ranks(tp_scenarios.summed_scores)):
        assert scale > 0.1 and diff <= 1e-5 * scale, (diff, scale)
