"""The launcher: results per rank, failures reported with tracebacks, no hangs."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tensorpar import RankError, RankPool, init_tensor_parallel, launch, tp_rank, tp_size


def _whoami():
    return tp_rank(), tp_size(), dist.get_backend()


def _collect_after_a_cycle():
    import gc

    cycle = [torch.ones(1)]
    cycle.append(cycle)
    del cycle
    return gc.get_freeze_count(), gc.collect()


def test_ranks_freeze_what_they_imported():
    """A rank's imports (torch, ...) are frozen out of garbage collection (launch/local.py);
    what it allocates afterwards is still collected."""
    for frozen, freed in launch(_collect_after_a_cycle, 2):
        assert frozen > 100_000 and freed >= 2, (frozen, freed)


def _fail_on_rank_one_while_others_wait():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    dist.all_reduce(torch.ones(1))  # the other ranks block here, waiting for rank 1
    return "unreachable"


def test_launch_returns_each_ranks_result():
    assert launch(_whoami, 3) == [(0, 3, "gloo"), (1, 3, "gloo"), (2, 3, "gloo")]


def test_failing_rank_is_reported_and_the_others_stopped():
    """A rank that raises while the others wait in a collective: its traceback comes back, the
    waiting ranks are stopped after the grace period, and the pool refuses further work."""
    pool = RankPool(3, grace_s=2)
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        pool.run(_fail_on_rank_one_while_others_wait)
    assert time.monotonic() - start < 60
    assert "rank 1 failed" in str(err.value) and "boom on rank one" in str(err.value)
    assert not err.value.expected  # a RuntimeError: a bug, told with its traceback
    assert err.value.one_line() == "rank 1: boom on rank one (ranks [0, 2] did not finish)"
    assert all(not p.is_alive() for p in pool._procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_whoami)


def test_grace_is_at_most_the_collective_timeout(monkeypatch):
    """With ranks whose collectives time out sooner than the pool's 10 s grace (``tensorpar
    --timeout 2``), the pool waits that long for the others once one has failed: a rank stuck
    in a collective with the failed one has given up by then."""
    from tensorpar.runtime.groups import TIMEOUT_ENV

    monkeypatch.setenv(TIMEOUT_ENV, "2")
    with RankPool(2, threads=1) as pool:
        assert pool.grace_s == 2.0
        start = time.monotonic()
        with pytest.raises(RankError, match="boom on rank one"):  # rank 0's timeout, or the
            pool.run(_fail_on_rank_one_while_others_wait)  # grace, whichever comes first
        assert time.monotonic() - start < 10, "waited the whole 10 s grace"


def _attached_tensor():
    return torch.ones(2, requires_grad=True) * 2  # part of an autograd graph: not picklable


def test_a_result_that_cannot_be_sent_back_is_an_error(ranks):
    """A function that returns what cannot be pickled (a tensor still part of an autograd graph)
    fails on every rank, naming the function and the fix, instead of leaving the launcher to
    wait for a result that never comes; the pool goes on."""
    pool = ranks(2)
    with pytest.raises(RankError, match="_attached_tensor returned a value that cannot be sent"):
        pool.run(_attached_tensor)
    assert pool.run(_whoami)[1][:2] == (1, 2)


def _die():
    os._exit(3)


def test_dead_rank_is_reported():
    with RankPool(2) as pool, pytest.raises(RankError, match=r"died \(exit codes \[3"):
        pool.run(_die)


def _world_without_launcher(env: dict, conn) -> None:
    os.environ.clear()
    os.environ.update(env)
    group = init_tensor_parallel()
    conn.send((dist.get_world_size(group), dist.get_backend()))
    dist.destroy_process_group()


def test_init_single_process_without_launcher():
    """No launcher environment: a world of one on gloo, in a new process with no process group
    yet (forked from the session's fork server, which has imported torch: a fresh interpreter
    would spend 3-5 s on that)."""
    from tensorpar.ranks.forkserver import rank_context

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    ctx = rank_context()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_world_without_launcher, args=(env, theirs))
    proc.start()
    try:
        assert mine.poll(120), f"no answer (exit code {proc.exitcode})"
        assert mine.recv() == (1, "gloo")
    finally:
        proc.join(30)
        if proc.is_alive():  # stuck: nothing left behind
            proc.kill()
            proc.join()
    assert proc.exitcode == 0


def test_tp_size_must_divide_world():
    """The ValueError is raised on every rank (so none waits for the others)."""
    with pytest.raises(RankError) as err:
        launch(_bad_tp, 4)
    message = str(err.value)
    assert message.count("ValueError: tp_size=3 must be >= 1 and divide the world size 4") == 4
    assert err.value.expected  # a ValueError: said in one line for all four ranks
    assert err.value.one_line() == ("ranks 0, 1, 2, 3: tp_size=3 must be >= 1 and divide the "
                                    "world size 4")


def _bad_tp():
    init_tensor_parallel(tp_size=3)


def _verify_on_subgroup():
    from tensorpar.cli.verify import expected_collectives, verify_rank
    from tensorpar.transformer.reference import BlockConfig

    group = init_tensor_parallel(tp_size=2)
    cfg = BlockConfig()
    result = verify_rank(cfg, True, seed=0, group=group)
    # ~10x the largest relative error measured (2026-11-27, torch 2.13 CPU): 4.2e-7 (tensorpar
    # verify's own bound, TOLERANCE, is 1e-5)
    assert max(result["errors"].values()) <= 5e-6, result["errors"]
    assert result["counts"] == expected_collectives(cfg, 2, True)
    return tp_rank(group), tp_size(group)


def test_layers_on_tp_subgroups():
    """World of 4 split into TP groups of consecutive ranks, {0, 1} and {2, 3}: every layer uses
    only its group (group=...), and both groups reproduce the dense model with the TP=2
    collective counts."""
    assert launch(_verify_on_subgroup, 4) == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_ranks_start_again_when_their_port_was_taken(monkeypatch):
    """The port found free is taken (here: listened on) before rank 0's store binds it: the
    pool starts its ranks again on another port, and they run."""
    import socket

    from tensorpar.ranks import local

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        found = local.free_port
        monkeypatch.setattr(local, "free_port", lambda: ports.pop() if ports else found())
        with RankPool(2, backend="gloo", threads=1, timeout_s=60, grace_s=2) as pool:
            assert pool.run(_whoami) == [(0, 2, "gloo"), (1, 2, "gloo")]
        assert ports == []
