"""The GPT under ``torch.compile``: one graph, no breaks (forward and the autograd Functions'
backwards, collectives included), and the same loss and gradients as the one-device eager model.

Most checks use the ``aot_eager`` backend (dynamo's graph capture and AOT autograd's backward,
without code generation: seconds instead of tens of seconds); one runs inductor, the default of
``torch.compile``, through the functional collectives' lowering at TP=2 with uneven SP shards.
"""

import pytest
import torch
import torch._dynamo as dynamo

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.embedding import VocabParallelEmbedding

from tp_check import assert_close, assert_grads, solo_group

TINY = {"vocab_size": 50, "n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 40}
# compiled against eager: ~10x the largest relative error measured over the tests' cases
# (2026-11-27, torch 2.13 CPU)
LOSS_TOL = 2e-6  # measured 1.8e-7 (aot_eager, TP=2, step 1)
GRAD_TOL = 6e-6  # measured 5.3e-7 (q_proj's gradient, dropout, TP=2)
# the compiled runs: (n, sp) of the model alone, (n, sp, recompute) with dropout
COMPILED = [(1, False), (2, False), (2, True)]
DROPPED = [(1, False, True), (2, False, False), (2, True, True)]


def _batch(T=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (2, T), generator=g), torch.randint(0, 50, (2, T), generator=g)


def _breaks_body(sp, fused, recompute, dropout):
    """(graphs, breaks, reasons) of dynamo's trace of the forward and loss of a one-block GPT."""
    ids, targets = _batch()
    dynamo.reset()
    model = GPT(GPTConfig(**TINY | {"dropout": dropout, "n_layer": 1}), sequence_parallel=sp,
                fused=fused, recompute=recompute)
    try:
        ex = dynamo.explain(model)(ids, targets)
        return ex.graph_count, ex.graph_break_count, [str(b.reason)[:200] for b in
                                                      ex.break_reasons]
    finally:
        dynamo.reset()


def _graphs():
    """(graphs, breaks, reasons) of what dynamo compiled in this process since its counters
    were cleared."""
    from torch._dynamo.utils import counters

    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            [reason[:200] for reason in counters["graph_break"]])


def test_one_graph_no_breaks(ranks, compiled, dropped):
    """dynamo traces the whole model in one graph: the embedding's id check is a device-side
    assert, the cross-entropy's vocabulary split is static (``vocab_size``), the collectives
    (in forward and in the autograd Functions' backwards, which dynamo traces too) are
    functional ones, and a dropout mask is one custom op (``tensorpar::dropout_mask``: no
    ``torch.Generator`` in the graph; a recomputed block's key is taken outside the
    checkpoint, which allows no side effect). The fused model (two blocks) as the compiled
    runs below compiled it, at TP=1 and 2, with SP, recomputation and dropout; the plain one
    with recomputation at TP=2 (one block), explained."""
    ran = {f"TP={n}{' SP' * sp}": compiled(n, sp) for n, sp in COMPILED}
    ran |= {f"TP={n}{' SP' * sp}{' recompute' * recompute} dropout": dropped(n, sp, recompute)
            for n, sp, recompute in DROPPED}
    for what, result in ran.items():
        graphs, breaks, reasons = result["graphs"]
        assert (graphs, breaks) == (1, 0), (what, reasons)
    for graphs, breaks, reasons in ranks(2).run(_breaks_body, False, False, True, 0.0):
        assert (graphs, breaks) == (1, 0), ("TP=2 plain recompute", reasons)


def _recording_aot_eager(ops):
    """``aot_eager`` that appends the call_function targets of the AOT forward and backward
    graphs it compiles to ``ops["forward"]`` and ``ops["backward"]``."""
    from functools import partial

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.debugging import aot_eager

    def keeping(graph):
        def compiler(gm, example_inputs):
            ops[graph] += [str(node.target) for node in gm.graph.nodes
                           if node.op == "call_function"]
            return make_boxed_func(gm.forward)  # aot_eager's own compiler: the graph as is
        return compiler

    return partial(aot_eager, fw_compiler=keeping("forward"), bw_compiler=keeping("backward"))


def _compiled_body(backend, sp, steps, n_layer=TINY["n_layer"]):
    """The compiled model against the one-device eager one, ``steps`` steps, gradients summed;
    with ``backend`` "aot_eager", the call_function targets of the AOT forward and backward
    graphs of the first step (the graphs the next steps run again), and ``"graphs"``: what
    dynamo made of it (``_graphs``)."""
    from torch._dynamo.utils import counters

    counters.clear()  # what this model's compile makes: _graphs()
    cfg = GPTConfig(**TINY | {"n_layer": n_layer})
    dense = GPT(cfg, solo_group(), seed=3)
    model = GPT(cfg, None, sequence_parallel=sp, seed=3)
    ops = {"forward": [], "backward": []}
    if backend == "aot_eager":
        backend = _recording_aot_eager(ops)
    compiled = torch.compile(model, backend=backend)
    try:
        for step in range(steps):  # a second step runs the compiled graphs again, grads summed
            ids, targets = _batch(seed=step)
            loss_ref, loss = dense(ids, targets), compiled(ids, targets)
            assert_close(f"loss at step {step}", loss, loss_ref, LOSS_TOL)
            loss_ref.backward()
            loss.backward()
            if step == 0:
                first = {graph: list(found) for graph, found in ops.items()}
                first["graphs"] = _graphs()
        assert_grads(dense, model, tol=GRAD_TOL)
    finally:  # the pool's rank runs other tests next: its compile caches hold the model
        dynamo.reset()
    return first


@pytest.fixture(scope="module")
def compiled(ranks):
    """``compiled(n, sp)``: rank 0's graph ops and graphs of ``_compiled_body`` (aot_eager, 2
    steps) at TP=n, run once per module: every rank's compiled steps equal the one-device
    model's."""
    made = {}

    def get(n, sp):
        if (n, sp) not in made:
            made[n, sp] = ranks(n).run(_compiled_body, "aot_eager", sp, 2)[0]
        return made[n, sp]

    return get


@pytest.mark.parametrize("n,sp", COMPILED)
def test_compiled_equals_one_device(compiled, n, sp):
    """Two steps of the compiled model (aot_eager) at TP=n: the losses and the summed gradients
    of the one-device eager model, on every rank (``_compiled_body`` compares them)."""
    assert compiled(n, sp)["forward"]


@pytest.mark.parametrize("n,sp", COMPILED)
def test_compiled_column_backward_is_one_op(compiled, n, sp):
    """Compiled, a fused column op's backward is one opaque op (``tensorpar::column_backward``)
    that reduces dx while it computes the weight gradients (under SP, gathering its input
    again while it computes dx), as in eager (``tests/core/test_fused.py``): the traced graph
    would wait for each functional collective at once. So at TP=2 the backward graph holds one
    such op per column op (Q/K/V and gate/up in each block, the LM head), and without SP no
    functional collective (under SP the norms' regions keep theirs); at TP=1 there is nothing
    to reduce."""
    ops = compiled(n, sp)["backward"]
    column_ops = ops.count("tensorpar.column_backward.default")
    assert column_ops == (2 * TINY["n_layer"] + 1 if n > 1 else 0), ops
    assert sp or not [op for op in ops if "c10d" in op], ops


def test_compiled_rotary_table_is_made_once(compiled):
    """The rotary table is one op in the compiled forward (``tensorpar::rotary_table``), made
    once for every block: inlined, inductor computed float64 cosines and sines again for each
    element it rotated, in every block and again in backward."""
    ops = compiled(2, True)
    assert ops["forward"].count("tensorpar.rotary_table.default") == 1, ops["forward"]
    trig = [op for op in ops["forward"] + ops["backward"]
            if op.startswith(("aten.cos", "aten.sin"))]
    assert not trig, trig


def _compiled_dropout_body(sp, recompute, steps=2):
    """Compiled and eager, both with dropout at this TP size, step by step as a trainer runs
    them (``rng.set_step`` before each forward): the same masks, so the same losses and
    gradients. Without SP the stream is the replicated one, the same at every TP size, so the
    compiled model is compared with the one-device eager model instead. Returns what dynamo
    made of the first step (``_graphs``)."""
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = GPTConfig(**TINY | {"dropout": 0.2})
    ref = GPT(cfg, None if sp else solo_group(), sequence_parallel=sp, seed=3,
              recompute=recompute)
    model = GPT(cfg, None, sequence_parallel=sp, seed=3, recompute=recompute)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        for step in range(steps):
            ids, targets = _batch(seed=step)
            ref.rng.set_step(step)
            model.rng.set_step(step)
            loss_ref, loss = ref(ids, targets), compiled(ids, targets)
            assert_close(f"loss at step {step}", loss, loss_ref, LOSS_TOL)
            loss_ref.backward()
            loss.backward()
            if step == 0:
                graphs = _graphs()
        if sp:  # both hold this rank's shards
            for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert_close(f"grad {name}", a.grad, b.grad, GRAD_TOL)
        else:
            assert_grads(ref, model, tol=GRAD_TOL)
        off = GPT(cfg, None, sequence_parallel=sp, seed=3).eval()  # the same weights (the
        off.load_state_dict(model.state_dict())  # step's), no dropout: other losses
        assert abs(off(*_batch(seed=steps - 1)).item() - loss.item()) > 1e-4
    finally:
        dynamo.reset()
    return {"graphs": graphs}


@pytest.fixture(scope="module")
def dropped(ranks):
    """``dropped(n, sp, recompute)``: rank 0's ``_compiled_dropout_body`` at TP=n, run once per
    module: every rank's compiled steps draw the eager model's masks."""
    made = {}

    def get(n, sp, recompute):
        if (n, sp, recompute) not in made:
            made[n, sp, recompute] = ranks(n).run(_compiled_dropout_body, sp, recompute)[0]
        return made[n, sp, recompute]

    return get


@pytest.mark.parametrize("n,sp,recompute", DROPPED)
def test_compiled_dropout_draws_eager_masks(dropped, n, sp, recompute):
    assert dropped(n, sp, recompute)["graphs"]


def _compiles_once_body():
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    model = GPT(GPTConfig(**TINY | {"dropout": 0.5}), None, seed=3)
    compiled = torch.compile(model, backend="aot_eager")
    ids, targets = _batch()
    try:
        losses = [compiled(ids, targets).item() for _ in range(3)]
        model.rng.set_step(1)
        losses.append(compiled(ids, targets).item())
        model.rng.set_step(0)
        again = compiled(ids, targets).item()
        return counters["stats"]["unique_graphs"], losses, again
    finally:
        dynamo.reset()


def test_dropout_compiles_once(ranks):
    """The dropout keys are tensors, not Python counters that dynamo would guard on: forwards
    with and without ``rng.set_step`` in between run the first compiled graph, and each draws
    new masks (step 0's first forward again after ``set_step(0)``)."""
    graphs, losses, again = ranks(1).run(_compiles_once_body)[0]
    assert graphs == 1
    assert len(set(losses)) == 4, losses
    assert again == losses[0]  # the same graph on the same masks: bit for bit


@pytest.mark.parametrize("sp", [True, False])
def test_inductor_at_tp2(ranks, sp):
    """inductor's code at TP=2: with SP its functional collectives lowered, T=13 split 7 + 6
    over two ranks; without, the column ops' backward custom op called from it (one block:
    inductor's compile time grows with the graph, and one block has every kind of op)."""
    assert all(ranks(2).run(_compiled_body, "inductor", sp, 1, 1))


def test_bad_ids_under_compile_are_a_device_side_assert():
    """No host read of the ids when compiled: an id outside the vocabulary fails the graph's
    assert with the vocabulary in its message (eager on the CPU raises ValueError with the
    numbers: tests/core/test_vocab.py)."""
    emb = torch.compile(VocabParallelEmbedding(50, 8), backend="aot_eager")
    assert emb(torch.tensor([[0, 49]])).shape == (1, 2, 8)
    with pytest.raises(RuntimeError, match=r"ids: a value is outside \[0, 50\)"):
        emb(torch.tensor([[0, 50]]))
