"""Multi-node through torchrun's rendezvous: two torchrun "nodes" on this machine
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1) train TP=2 inside each node and
DP=2, or two pipeline stages, across them, and the losses are those of one node with 4 ranks."""

import shutil
import subprocess
import sys

import pytest

from tensorpar.gpt.model import GPTConfig
from tensorpar.ranks.local import free_port
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

from tests_common import TINY_GPT, checkout_env, read_metrics

STEPS = 4
MODEL = {"n_layer": 1, "dim": 32, "n_head": 4, "n_kv_head": 1}
# across the nodes: the data-parallel groups (--dp from the world size), or the pipeline
PIPELINE = {"pp": 2, "micro_batch_size": 2}
PIPELINE_MODEL = {"n_layer": 2, "tie_embeddings": False}
PIPELINE_FLAGS = ["--pp", "2", "--micro-batch-size", "2", "--n-layer", "2",
                  "--no-tie-embeddings"]


def _one_node(out, pipeline):
    """The same run on one node's 4 ranks (the test pool, tp 2 x dp 2 or tp 2 x pp 2)."""
    layout = PIPELINE if pipeline else {"dp": 2}
    cfg = TrainConfig(tp=2, steps=STEPS, batch_size=4, seq_len=32, warmup_steps=3, seed=2,
                      out=out, **layout)
    model = MODEL | (PIPELINE_MODEL if pipeline else {})
    return train_rank(cfg, GPTConfig(**model), None).get("rows")


def _two_nodes(port: int, out, pipeline: bool):
    """Two torchrun nodes of 2 ranks each training to ``out``, meeting at ``port``: the nodes'
    processes, ended, and their (stdout, stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "tensorpar-test", "-m", "tensorpar", "train", "--tp", "2",
           "--steps", str(STEPS), "--out", str(out), *TINY_GPT,
           *(PIPELINE_FLAGS if pipeline else [])]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=checkout_env()) for _ in range(2)]
    try:
        return nodes, [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.parametrize("pipeline", [False, True], ids=["dp-across", "pp-across"])
def test_two_torchrun_nodes_equal_one_node(ranks, tmp_path, pipeline):
    """Each node's ranks are consecutive global ranks (torchrun numbers node by node), so a TP
    group stays inside a node and the dp groups (or the pipeline's stages, the outermost mesh
    dimension) cross the nodes; without --pp the run reads --dp from the world size (4 / --tp
    2). The losses are the same bit for bit: the same ranks compute the same operations, one
    thread each (torchrun's default with several ranks per node, the pool's)."""
    out = tmp_path / "two-nodes"
    for attempt in range(1, 4):  # the port found free may be taken before the store binds it
        nodes, logs = _two_nodes(free_port(), out, pipeline)
        if attempt == 3 or not any("EADDRINUSE" in err for _, err in logs):
            break
        shutil.rmtree(out, ignore_errors=True)
    for node, (_, err) in zip(nodes, logs, strict=True):
        assert node.returncode == 0, err
    summary = "".join(log[0] for log in logs)
    assert ("TP=2 x PP=2" if pipeline else "TP=2 x DP=2 (fsdp)") in summary, summary
    two_nodes = read_metrics(out)
    one_node = ranks(4).run(_one_node, str(tmp_path / "one-node"), pipeline)[0]
    assert [r["step"] for r in two_nodes] == [r["step"] for r in one_node] == [1, 2, 3, 4]
    for a, b in zip(two_nodes, one_node, strict=True):
        assert a["loss"] == b["loss"], (a, b)
