"""``tensorpar train --compile`` and ``--tf32`` (train/compute.py): compiled training follows
eager's losses bit for bit at TP=1 and 2, to fp32 rounding with data parallelism, its
checkpoints keep plain parameter names, and a run resumes across --compile and --no-compile;
--tf32 on the CPU changes nothing and says so.

Compiled with ``aot_eager`` (dynamo and AOT autograd, no code generated): the tracing is what
can go wrong, and inductor's C++ compile would take a minute per run on 2 cores.
"""

import json
import shutil

import pytest
import torch

from tensorpar.gpt.model import GPTConfig
from tensorpar.runtime.groups import DEVICE_ENV
from tensorpar.train.compute import tf32_matmuls
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank
from tensorpar.train.run import resolve

# one block: it holds every kind of op the graph traces (a second doubles the tracing, 3 s of
# a rank's CPU a compiled run, and adds none)
MODEL = {"n_layer": 1, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 64}
STEPS = 4


COMPILED_CALLS = [0]  # calls of the compiled forward graphs, in this process


def _counting_aot_eager(gm, example_inputs):
    """``aot_eager``, counting the calls of what it compiled."""
    from torch._dynamo.backends.registry import lookup_backend

    compiled = lookup_backend("aot_eager")(gm, example_inputs)

    def run(*args):
        COMPILED_CALLS[0] += 1
        return compiled(*args)

    return run


def _train(out, tp, compile=False, resume_from=None, **flags):
    """Train on every rank; rank 0 returns the losses, how many graphs dynamo compiled and how
    many times a compiled graph ran."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if "counting_aot_eager" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_counting_aot_eager, "counting_aot_eager")
    torch._dynamo.reset()  # a pool's ranks compile many models: no cache, no recompile limit
    counters.clear()
    COMPILED_CALLS[0] = 0
    cfg = TrainConfig(tp=tp, steps=STEPS, batch_size=4, seq_len=32, warmup_steps=2, out=out,
                      save_every=2, seed=1, compile=compile,
                      compile_backend="counting_aot_eager", **flags)
    rows = train_rank(cfg, GPTConfig(**MODEL), resume_from).get("rows")
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # the caches hold the model: the rank runs other tests next
    return rows and [r["loss"] for r in rows], graphs, COMPILED_CALLS[0]


def _close(a, b, tol):
    assert all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b, strict=True)), (a, b)


@pytest.fixture(scope="module")
def eager(ranks, tmp_path_factory):
    """The eager runs at TP=1 and 2: {tp: (run directory, losses)}."""
    runs = {}
    for tp in (1, 2):
        out = tmp_path_factory.mktemp(f"eager{tp}")
        runs[tp] = out, ranks(tp).run(_train, str(out), tp)[0][0]
    return runs


@pytest.mark.parametrize("tp", [2])
def test_compiled_training_follows_eager(ranks, tmp_path, eager, tp):
    """4 AdamW steps (fp32) at TP=2 under torch.compile: the same losses as eager, bit for bit;
    every step but the measured one (the second, under the collective counter and the memory
    meter) runs the compiled graph, the steps after it too; the checkpoint names the parameters
    as the eager run's does (no ``_orig_mod.``); resumed eagerly from its step 2, it repeats
    its steps 3-4. (TP=1 compiled: under DDP below, and the model alone in
    tests/gpt/test_compile_model.py.)"""
    losses, graphs, calls = ranks(tp).run(_train, str(tmp_path / "c"), tp, True)[0]
    assert graphs >= 1 and calls == STEPS - 1, (graphs, calls)
    assert losses == eager[tp][1], (losses, eager[tp][1])
    names = [json.loads((d / "step-00000004" / "manifest.json").read_text())["tensors"]
             for d in (tmp_path / "c", eager[tp][0])]
    assert list(names[0]) == list(names[1]) and not any("_orig_mod" in n for n in names[0])
    shutil.copytree(tmp_path / "c", tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "step-00000004")
    resumed, _, _ = ranks(tp).run(_train, str(tmp_path / "r"), tp, False,
                                  str(tmp_path / "r" / "step-00000002"))[0]
    assert resumed == losses, (resumed, losses)


@pytest.mark.parametrize("tp,dp,mode", [(1, 2, "ddp"), (2, 2, "fsdp")])
def test_compiled_training_with_data_parallelism(ranks, tmp_path, eager, tp, dp, mode):
    """--compile with --dp: torch.compile around the model that DDP wraps (dynamo splits the
    graph at DDP's gradient buckets) or that FSDP2 shards (its hooks run between the graphs).
    TP=1 x DP=2 under DDP and TP=2 x DP=2 under FSDP2: the losses of the eager TP=1 run to fp32
    rounding (~10x the largest relative difference measured, 1.7e-7 at TP=2 x DP=2; 2026-11-27,
    torch 2.13 CPU), and every step but the measured one runs compiled graphs."""
    losses, graphs, calls = ranks(tp * dp).run(_train, str(tmp_path / "c"), tp, True, None,
                                               dp=dp, dp_mode=mode)[0]
    assert graphs >= 1 and calls >= STEPS - 1 and calls % (STEPS - 1) == 0, (graphs, calls)
    _close(losses, eager[1][1], 2e-6)


def test_eager_checkpoint_resumes_compiled(ranks, tmp_path, eager):
    """An eager run's step-2 checkpoint, resumed with --compile at TP=2: eager's steps 3-4."""
    shutil.copytree(eager[1][0], tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "step-00000004")
    resumed, graphs, calls = ranks(2).run(_train, str(tmp_path / "r"), 2, True,
                                          str(tmp_path / "r" / "step-00000002"))[0]
    assert graphs >= 1 and calls == 1  # step 3 compiled; step 4, the run's second, measured
    # saved at TP=1: TP=2's rounding (measured 0 here; the floor: a few fp32 ulps)
    _close(resumed, eager[2][1], 1e-6)


def test_tf32_on_the_cpu_changes_nothing_and_says_so(ranks, tmp_path, eager, capsys,
                                                     monkeypatch):
    """--tf32 where the ranks run on the CPU: a note, stored with the run, the same losses."""
    monkeypatch.setenv(DEVICE_ENV, "cpu")  # as on a machine without a GPU
    cfg, _, _ = resolve({"tf32": True, "out": str(tmp_path / "t"), "tp": 1},
                        {"n_layer": 1, "dim": 32, "n_head": 4})
    assert cfg.tf32
    assert "note: --tf32 does nothing here: the ranks run on the CPU" in capsys.readouterr().err
    assert ranks(1).run(_train, str(tmp_path / "t"), 1, tf32=True)[0][0] == eager[1][1]
    manifest = json.loads((tmp_path / "t" / "step-00000004" / "manifest.json").read_text())
    assert manifest["train"]["tf32"] and not manifest["train"]["compile"]


def test_tf32_flags_are_set_for_the_block_only():
    """On a GPU the run turns TF32 on (torch's flags, process-wide) and back off after it, so a
    pool's ranks run their next job as before; on the CPU it touches nothing."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    with tf32_matmuls(True, torch.device("cpu")):
        assert matmul.allow_tf32 == before
    with tf32_matmuls(True, torch.device("cuda")):
        assert matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert matmul.allow_tf32 == before
