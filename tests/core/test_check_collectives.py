"""Ranks that feed a collective different shapes: with the check mode, an error on every rank in
one line naming the layer, the collective and each rank's shape; without it, gloo aborts a rank
and the launcher names it, how it died, and the flag that would have named the layer.

The mismatches are ones no change to the layers makes right: different batch sizes on different
ranks (the sequence shards of the SP test have equal lengths)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from tensorpar.cli import export as cli_export
from tensorpar.cli import main as cli
from tensorpar.cli import train as cli_train
from tensorpar.cli import verify as cli_verify
from tensorpar.parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.ranks.checking import CHECK_HINT, naming_layers
from tensorpar.ranks.failures import (
    CollectiveMismatch,
    RankError,
    RankFailure,
    collective_mismatch,
    rank_list,
)
from tensorpar.ranks.local import launch
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import CHECK_ENV, checks_wanted, collectives_checked, tp_rank

from tests_common import checkout_env, cli_env, pools_checked, tensorpar_here


def _torch_says(rank: int, shape: str, other: int, other_shape: str) -> str:
    """What torch 2.13's ProcessGroupWrapper raises on ``rank`` (TensorOptions shortened)."""
    def call(r, s):
        return (f"Rank {r} is running collective: CollectiveFingerPrint(SequenceNumber=0, "
                f"OpType=ALLREDUCE, TensorShape=[{s}], TensorDtypes=Float, TensorDeviceTypes="
                "TensorOptions(dtype=float (default), device=cpu))")
    return (f"Detected mismatch between collectives on ranks. {call(rank, shape)}, but "
            f"{call(other, other_shape)}.Collectives differ in the following aspects:   Tensor "
            f"Tensor shapes: {shape.replace(',', '')}vs {other_shape.replace(',', '')}")


@pytest.fixture
def unset(monkeypatch):
    """No TENSORPAR_CHECK_COLLECTIVES now, and none after the test whatever cli.main sets (a
    delenv of an absent variable alone is not undone)."""
    monkeypatch.setenv(CHECK_ENV, "")
    monkeypatch.delenv(CHECK_ENV)


@pytest.fixture
def checked(ranks):
    """The session's four gloo ranks, which check their collectives (conftest.py)."""
    pool = ranks(4)
    assert pool.checked
    return pool


class _MLP(nn.Module):
    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.up = ColumnParallelLinear(16, 32, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear(32, 16, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.down(self.up(x))


class _Model(nn.Module):
    """One block, so that the layers have the dotted names of a real model."""

    def __init__(self, sequence_parallel: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"mlp": _MLP(sequence_parallel)})])

    def forward(self, x):
        for block in self.blocks:
            x = block["mlp"](x)
        return x


def _batch(rank_zero: int = 3, others: int = 2, tokens: int = 8) -> torch.Tensor:
    """(B, T, 16): B = 3 on rank 0, 2 on the others."""
    return torch.randn(rank_zero if tp_rank() == 0 else others, tokens, 16, requires_grad=True)


def _forward_mismatch():
    model = _Model()
    with naming_layers(model):
        model(_batch())


def _backward_mismatch():
    """A column layer alone: no collective in forward; backward all-reduces the input grad."""
    model = ColumnParallelLinear(16, 32)
    with naming_layers(model):
        model(_batch()).sum().backward()


def _sequence_mismatch():
    """Sequence shards of 2 tokens everywhere; the batch differs."""
    model = _Model(sequence_parallel=True)
    with naming_layers(model):
        model(_batch(tokens=2))


def _counts():
    """One forward and backward of the MLP in the checked group: the counter sees only ours."""
    model = _MLP(sequence_parallel=False)
    x = _batch(2, 2)
    with CollectiveCounter() as fwd:
        y = model(x)
    with CollectiveCounter() as bwd:
        y.sum().backward()
    return collectives_checked(), dict(fwd.counts), dict(bwd.counts)


def test_forward_mismatch_names_layer_op_and_shapes(checked):
    """A RowParallelLinear fed a batch of 3 on rank 0 and 2 on ranks 1-3: every rank raises, an
    expected error, said in one line; the pool still works afterwards."""
    with pytest.raises(RankError) as err:
        checked.run(_forward_mismatch)
    e = err.value
    assert [f.kind for f in e.failures] == ["CollectiveMismatch"] * 4 and e.expected
    assert e.one_line() == ("collective mismatch in blocks.0.mlp.down (forward): rank 0 "
                            "all_reduce [3, 8, 16] float32; ranks 1-3 all_reduce [2, 8, 16] "
                            "float32")
    assert all(c[0] for c in checked.run(_counts))


def test_backward_mismatch(checked):
    """In backward the place is the autograd function that issued the collective."""
    with pytest.raises(RankError) as err:
        checked.run(_backward_mismatch)
    assert err.value.expected and len(err.value.failures) == 4
    assert re.fullmatch(r"collective mismatch in backward \(\w+\.backward\): rank 0 all_reduce "
                        r"\[3, 8, 16\] float32; ranks 1-3 all_reduce \[2, 8, 16\] float32",
                        err.value.one_line()), err.value.one_line()


def test_sequence_parallel_mismatch(checked):
    """ColumnParallelLinear(sequence_parallel=True): its all-gather of the sequence shards is
    refused on every rank, naming the layer."""
    with pytest.raises(RankError) as err:
        checked.run(_sequence_mismatch)
    line = err.value.one_line()
    assert err.value.expected and len(err.value.failures) == 4
    m = re.fullmatch(r"collective mismatch in blocks\.0\.mlp\.up \(forward\): rank 0 all_gather "
                     r"\[([\d, ]+)\] float32; ranks 1-3 all_gather \[([\d, ]+)\] float32", line)
    assert m, line
    assert "3" in m[1].split(", ") and "3" not in m[2].split(", "), line


def test_counts_unchanged_by_the_check(checked):
    """torch's fingerprint exchange runs on its own side group, below the dispatcher: the
    CollectiveCounter sees the layers' collectives only (Megatron's: one all-reduce each way)."""
    for on, fwd, bwd in checked.run(_counts):
        assert on and fwd == {"all_reduce": 1} and bwd == {"all_reduce": 1}


def _unchecked_mismatch():
    torch.distributed.all_reduce(_batch())


def _cli_runs(body, check_collectives=None):
    def run(args):
        launch(body, 2, timeout_s=60, check_collectives=check_collectives)
        return 0
    return run


@pytest.mark.parametrize("flag", [[], ["--check-collectives"]])
def test_cli(monkeypatch, capsys, unset, flag):
    """``tensorpar train`` whose ranks feed all_reduce different shapes, exit 1 in under 30 s.
    Without the flag gloo aborts a rank: the line names it, SIGABRT, and the flag to use. With
    it (read by every spawned rank from the environment): the mismatch in one line."""
    monkeypatch.setattr(cli_train, "run", _cli_runs(_unchecked_mismatch))
    previous = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    try:
        assert cli.main([*flag, "train"]) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert time.monotonic() - start < 30
    last = capsys.readouterr().err.strip().splitlines()[-1]
    if flag:
        assert last == ("tensorpar train: collective mismatch: rank 0 all_reduce [3, 8, 16] "
                        "float32; rank 1 all_reduce [2, 8, 16] float32")
    else:
        assert re.match(r"tensorpar train: rank\(s\) \[[01, ]+\] died \(exit codes \[[-6, ]+\]\): "
                        r"SIGABRT \(an abort", last), last
        assert last.endswith(f"; {CHECK_HINT}") and "--check-collectives" in last


def test_check_is_on_for_verify_by_default(monkeypatch, unset):
    """``tensorpar verify`` checks its collectives unless told not to; other commands do not."""
    seen = []
    for command in (cli_verify, cli_export):
        monkeypatch.setattr(command, "run", lambda args: seen.append(os.environ.get(CHECK_ENV)))
    for argv, want in ((["verify"], "1"), (["--no-check-collectives", "verify"], "0"),
                       (["verify", "--no-check-collectives"], "0"),
                       (["export", "--ckpt", "c", "--out", "o"], None)):
        os.environ.pop(CHECK_ENV, None)
        cli.main(argv)
        assert seen.pop() == want, argv


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), (" Yes", True), ("ON", True),
                                      ("", False), ("0", False), ("false", False),
                                      ("False", False), ("no", False), ("off ", False)])
def test_env_switch_reads_as_the_flag(monkeypatch, value, on):
    """TENSORPAR_CHECK_COLLECTIVES on or off, as --check-collectives / --no-check-collectives:
    for the ranks, and for the suite's pools (every one, or none)."""
    monkeypatch.setenv(CHECK_ENV, value)
    assert checks_wanted() is on
    assert pools_checked("train") is on and pools_checked("core") is on
    monkeypatch.setenv(CHECK_ENV, "core")
    assert (pools_checked("train"), pools_checked("core")) == (False, True)


def test_env_switch_neither_on_nor_off_is_one_line(monkeypatch, capsys, unset):
    """A value that is neither on nor off, of either switch: one line naming it, exit 2, no rank
    started."""
    for name in (CHECK_ENV, "TENSORPAR_DEBUG"):
        monkeypatch.setenv(name, "maybe")
        assert cli.main(["plan", "--model", "gpt2"]) == 2
        err = capsys.readouterr().err
        assert err == f"tensorpar plan: {name}='maybe': set it to 1 or 0 (or true/false, yes/no, " \
            "on/off)\n", err
        monkeypatch.delenv(name)


def test_suite_switch_stays_out_of_commands(monkeypatch):
    """The suite's TENSORPAR_CHECK_COLLECTIVES reaches neither a command run as a process
    (``cli_env``) nor one run in this process (``tensorpar_here``), and is back after."""
    seen = []
    monkeypatch.setattr(cli_export, "run", lambda args: seen.append(os.environ.get(CHECK_ENV)))
    monkeypatch.setenv(CHECK_ENV, "1")
    assert CHECK_ENV not in cli_env()
    tensorpar_here("export", "--ckpt", "c", "--out", "o")
    assert seen == [None] and os.environ[CHECK_ENV] == "1"


def test_torch_message_read():
    """torch's message read; four ranks' failures merged into one line: each rank's own call
    (torch names one other rank only, the first that differs)."""
    m = collective_mismatch(RuntimeError(_torch_says(1, "2, 8, 16", 0, "3, 8, 16")))
    assert isinstance(m, CollectiveMismatch) and m.where is None
    assert m.seen == {1: "all_reduce [2, 8, 16] float32", 0: "all_reduce [3, 8, 16] float32"}
    assert collective_mismatch(RuntimeError("Connection reset by peer")) is None
    said = [_torch_says(0, "3, 8, 16", 1, "2, 8, 16")]
    said += [_torch_says(r, "2, 8, 16", 0, "3, 8, 16") for r in (1, 2, 3)]
    failures = [RankFailure.of(r, collective_mismatch(RuntimeError(s), "mlp.down (forward)"))
                for r, s in enumerate(said)]
    assert RankError("", failures).one_line() == (
        "collective mismatch in mlp.down (forward): rank 0 all_reduce [3, 8, 16] float32; "
        "ranks 1-3 all_reduce [2, 8, 16] float32")
    assert [rank_list(r) for r in ([0], [1, 2, 3], [0, 2, 3, 5])] == [
        "rank 0", "ranks 1-3", "ranks 0, 2-3, 5"]


LOST_UNDER_TORCHRUN = '''
import os, signal
import torch, torch.distributed as dist
from tensorpar.ranks.failures import PeerLost
from tensorpar.ranks.local import run_ranks

def body(group=None):
    dist.all_reduce(torch.ones(1), group=group)  # both ranks are up
    if dist.get_rank(group) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1), group=group)

try:
    run_ranks(body, 2)
except PeerLost as e:
    print(f"rank {e.rank}: {e}", flush=True)
    raise SystemExit(3)
'''


def test_lost_rank_under_torchrun(tmp_path):
    """Under torchrun (the launcher is torchrun, whose report names the dead rank and its exit), a
    rank whose collective fails for want of the other says so in one line, with the hint, as an
    expected error (``PeerLost``), not a traceback; everything is gone well within 30 s."""
    script = tmp_path / "lost.py"
    script.write_text(LOST_UNDER_TORCHRUN)
    env = {k: v for k, v in checkout_env().items() if k != CHECK_ENV}
    start = time.monotonic()
    # a slow monitor: torchrun's SIGTERM to rank 0 must not overtake gloo's error (with the
    # default 0.1 s it seldom does: the error comes as soon as the dead rank's socket closes)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--monitor-interval", "5", str(script)], capture_output=True,
                         text=True, timeout=60, env=env, cwd=tmp_path)
    took = time.monotonic() - start
    said = out.stdout + out.stderr
    assert out.returncode != 0, said
    assert "rank 0: lost another rank (" in said and "torchrun's report names it" in said, said
    assert CHECK_HINT in said and took < 30, (took, said)
