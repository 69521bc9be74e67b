"""The fused path (QKV, gate/up and the head as one op each, backward collective overlapped)
against the plain layers: same loss, same gradients, same collectives, in fp32 and under bf16
autocast."""

import pytest
import torch

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.fused import ColumnLoRA, fused_column, fused_row
from tensorpar.parallel.linear import column_linears
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import tp_size

from tests_common import WORLD_SIZES
from tp_check import assert_close, leaf, shard

CFG = {"vocab_size": 50, "n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 40}


def _step(model, ids, targets, autocast):
    with CollectiveCounter() as counter, torch.autocast("cpu", torch.bfloat16,
                                                        enabled=autocast):
        loss = model(ids, targets)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss, grads, dict(counter.counts), dict(counter.bytes)


def _fused_vs_plain_body(sp, n_kv_head, autocast):
    cfg = GPTConfig(**(CFG | {"n_kv_head": n_kv_head, "tie_embeddings": False}))
    torch.manual_seed(0)
    ids, targets = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 12))
    plain = _step(GPT(cfg, None, sp, seed=3, fused=False), ids, targets, autocast)
    fused = _step(GPT(cfg, None, sp, seed=3, fused=True), ids, targets, autocast)
    # the loss bit for bit (the same F.linear per weight); the gradients too under bf16
    # autocast (the products summed in fp32 as the plain path's autograd sums them); in fp32
    # dx is accumulated in one buffer (addmm_): ~10x the largest relative error measured over
    # the cases, 2.0e-7 (q_proj's gradient, TP=4; 2026-11-27, torch 2.13 CPU)
    assert torch.equal(fused[0], plain[0]), (fused[0], plain[0])
    for name, g in plain[1].items():
        if autocast:
            assert torch.equal(fused[1][name], g), name
        else:
            assert_close(f"grad {name}", fused[1][name], g, 2e-6)
    assert fused[2:] == plain[2:], (fused[2:], plain[2:])  # same collectives and bytes
    return fused[2]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("sp,n_kv_head,autocast", [(False, 2, False), (True, 1, False),
                                                   (False, 2, True), (True, 4, True)])
def test_fused_gpt_equals_plain(ranks, n, sp, n_kv_head, autocast):
    """GPT(fused=True) and GPT(fused=False) compute the same loss and gradients and issue the
    same collectives with the same payloads (fp32, and bf16 autocast whose backward all-reduce
    stays in fp32 like the plain path's)."""
    ranks(n).run(_fused_vs_plain_body, sp, n_kv_head, autocast)


def test_fused_column_one_rank():
    """World size 1 (no process group at all): the fused op equals the separate linears, input and
    weight gradients included, with a bias on only some of the weights."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    ws = [torch.randn(n, 8, requires_grad=True) for n in (6, 3, 3)]
    bias = torch.randn(3, requires_grad=True)
    y = torch.cat(fused_column(x, ws, [None, bias, None]), -1)
    ref = torch.cat([x @ ws[0].T, x @ ws[1].T + bias, x @ ws[2].T], -1)
    # measured 0 for the output and 6.9e-8 for the gradients (2026-11-27, torch 2.13 CPU); the
    # floor: a few fp32 ulps
    assert_close("output", y, ref, 1e-6)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, [x, *ws, bias], g)
    want = torch.autograd.grad(ref, [x, *ws, bias], g)
    for a, b in zip(got, want, strict=True):
        assert_close("grad", a, b, 1e-6)
    with pytest.raises(ValueError, match="expected activations"):
        fused_column(x[0], ws)
    with pytest.raises(ValueError, match="3 weights but 1 biases"):
        fused_column(x, ws, [bias])


def test_fused_column_with_lora_one_rank():
    """LoRA adapters folded into the op (``ColumnLoRA``) on two of three outputs: the outputs
    and every gradient (input, weights, A, B) equal y_t + s (x A^T) B^T as separate linears;
    mismatched adapters and partial sums where no all-reduce carries them are one line."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    ws = [torch.randn(n, 8, requires_grad=True) for n in (6, 3, 4)]
    bias = torch.randn(3, requires_grad=True)
    a = [torch.randn(2, 8, requires_grad=True) for _ in range(2)]
    b = [torch.randn(n, 2, requires_grad=True) for n in (6, 4)]
    lora = ColumnLoRA(tuple(a), tuple(b), (0, 2), (0.5, 2.0))
    y = torch.cat(fused_column(x, ws, [None, bias, None], lora=lora), -1)
    ref = torch.cat([x @ ws[0].T + 0.5 * (x @ a[0].T) @ b[0].T, x @ ws[1].T + bias,
                     x @ ws[2].T + 2.0 * (x @ a[1].T) @ b[1].T], -1)
    # measured 0 for the output and 1.3e-7 for the gradients (torch 2.13 CPU): fp32 ulps
    assert_close("output", y, ref, 1e-6)
    g = torch.randn_like(ref)
    params = [x, *ws, bias, *a, *b]
    for got, want in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g),
                         strict=True):
        assert_close("grad", got, want, 1e-6)
    with pytest.raises(ValueError, match=r"LoRA targets \[0, 3\]"):
        fused_column(x, ws, lora=ColumnLoRA(tuple(a), tuple(b), (0, 3), (0.5, 2.0)))
    with pytest.raises(ValueError, match="not under SP"):
        fused_column(x, ws, sequence_parallel=True, lora=ColumnLoRA(a[:1], b[:1], (0,), (1.0,),
                                                                    partial=True))


# ~10x the largest relative error measured over the cases of test_sequence_parallel_column_ops:
# 2.4e-7 (the bias gradient, batch 2, TP=4; 2026-11-27, torch 2.13 CPU)
SP_COLUMN_TOL = 2.5e-6


def _sp_column_body(batch, keep):
    """fused_column and column_linears on a sequence shard against the dense matmuls."""
    torch.manual_seed(0)
    T, D, outs = 13, 10, (14, 5)  # 13 (tokens), 14 and 5 split unevenly over 2, 3 or 4 ranks
    x = torch.randn(batch, T, D)
    ws = [torch.randn(o, D) for o in outs]
    bias = torch.randn(outs[1])
    grads = [torch.randn(batch, T, o) for o in outs]
    ref_x, ref_ws, ref_b = leaf(x), [leaf(w) for w in ws], leaf(bias)
    refs = [ref_x @ ref_ws[0].T, ref_x @ ref_ws[1].T + ref_b]
    torch.autograd.backward(refs, grads)
    counts, kept = {}, []

    def pack(t):  # the sizes of what autograd keeps for backward (F.linear keeps 2-D views)
        kept.append(t.numel())
        return t

    for name, op in (("fused", fused_column), ("plain", column_linears)):
        xs, my_ws, my_b = leaf(shard(x, 1)), [leaf(shard(w, 0)) for w in ws], leaf(shard(bias, 0))
        kept.clear()
        with CollectiveCounter() as fwd, torch.autograd.graph.saved_tensors_hooks(
                pack, lambda t: t):
            ys = op(xs, my_ws, [None, my_b], sequence_parallel=True, keep_gathered_input=keep,
                    seq_len=T)
        with CollectiveCounter() as bwd:
            torch.autograd.backward(ys, [shard(g, -1) for g in grads])
        assert (x.numel() in kept) == (keep or tp_size() == 1), (name, kept)  # x_full kept?
        for y, ref in zip(ys, refs, strict=True):
            assert_close(f"{name} output", y, shard(ref, -1), SP_COLUMN_TOL)
        assert_close(f"{name} input grad", xs.grad, shard(ref_x.grad, 1), SP_COLUMN_TOL)
        for w, ref_w in zip(my_ws, ref_ws, strict=True):
            assert_close(f"{name} weight grad", w.grad, shard(ref_w.grad, 0), SP_COLUMN_TOL)
        assert_close(f"{name} bias grad", my_b.grad, shard(ref_b.grad, 0), SP_COLUMN_TOL)
        counts[name] = (dict(fwd.counts), dict(bwd.counts))
    return counts


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("batch,keep", [(2, False), (1, False), (2, True)])
def test_sequence_parallel_column_ops(ranks, n, batch, keep):
    """Under SP the fused op and the plain path (column_linears) keep only the (B, T/n, D) input
    shard for backward and all-gather it again there (B = 1 too, where the gathered buffer is
    already in order): outputs and gradients equal the dense matmuls', with one all-gather
    forward and one all-gather + one reduce-scatter backward; keep_gathered_input keeps the
    gathered input and skips the backward all-gather."""
    for counts in ranks(n).run(_sp_column_body, batch, keep):
        want = (({}, {}) if n == 1 else
                ({"all_gather": 1}, {"reduce_scatter": 1} | ({} if keep else {"all_gather": 1})))
        assert counts == {"fused": want, "plain": want}, counts


def _compiled_column_body(autocast, sp, keep=False):
    """fused_column compiled (aot_eager: dynamo and AOT autograd as inductor uses them) against
    eager, on this rank's uneven shards (of the sequence too, under SP), biases on some
    weights; and, profiled, the order of the work inside ``tensorpar::column_backward``."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    x, ws = torch.randn(2, 5, 8), [torch.randn(o, 8) for o in (7, 5)]
    bias, grads = torch.randn(5), [torch.randn(2, 5, o) for o in (7, 5)]
    my_ws, my_b = [shard(w, 0) for w in ws], shard(bias, 0)
    compiled = torch.compile(fused_column, backend="aot_eager", fullgraph=True)
    kw = {"sequence_parallel": True, "seq_len": x.shape[1],
          "keep_gathered_input": keep} if sp else {}
    out = {}
    try:
        for name, op in (("eager", fused_column), ("compiled", compiled)):
            leaves = [leaf(shard(x, 1) if sp else x), *(leaf(w) for w in my_ws), leaf(my_b)]
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                ys = op(leaves[0], leaves[1:3], [None, leaves[3]], **kw)
            with torch.profiler.profile() as prof:
                torch.autograd.backward(ys, [shard(g, -1).to(ys[0].dtype) for g in grads])
            out[name] = [*ys, *(t.grad for t in leaves)]
    finally:
        dynamo.reset()
    for i, (a, b) in enumerate(zip(out["compiled"], out["eager"], strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), (i, a.dtype, b.dtype)
    ops = [e for e in prof.events() if e.name == "tensorpar::column_backward"]
    if tp_size() == 1:
        return ops == []
    (op,) = ops  # its input gradient's collective starts before the weight gradients' matmuls
    inside = [e.name for e in sorted(op.cpu_children, key=lambda e: e.time_range.start)]
    kind = "reduce_scatter" if sp else "allreduce"
    first = min(i for i, n in enumerate(inside) if n.startswith("c10d::") and kind in n)
    return first < max(i for i, n in enumerate(inside) if n == "aten::mm")


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("autocast,sp,keep", [(False, False, False), (True, False, False),
                                              (False, True, False), (True, True, False),
                                              (False, True, True)])
def test_compiled_fused_column_equals_eager(ranks, n, autocast, sp, keep):
    """Compiled, the fused column op's backward is one custom op that runs the eager backward:
    outputs and every gradient equal eager's bit for bit and in the same dtypes (fp32, and bf16
    autocast, whose input gradient is fp32 and weight gradients bf16 products), uneven shards
    and a bias included, with and without SP (keeping the gathered input too); and inside it
    the all-reduce (under SP, the reduce-scatter) of the input gradient is started before the
    weight gradients' matmuls run (the wait for it, after them, leaves no event of its own to
    check)."""
    assert all(ranks(n).run(_compiled_column_body, autocast, sp, keep))


_PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_")
_COLLECTIVES = ("c10d::allreduce_", "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_",
                "c10d::_allgather_base_", "c10d::allgather_")


def _frozen_body(sp, compiled):
    """fused_column's backward with a frozen weight, or an input that needs no gradient, eager
    and compiled: the gradients asked for equal the full backward's, the others are None, and
    neither their matmuls nor (for the input) its collective run."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    x, ws = torch.randn(2, 5, 8), [torch.randn(o, 8) for o in (7, 5)]
    grads = [torch.randn(2, 5, o) for o in (7, 5)]
    op = torch.compile(fused_column, backend="aot_eager", fullgraph=True) \
        if compiled else fused_column
    kw = {"sequence_parallel": True, "seq_len": x.shape[1]} if sp else {}
    seen = {}
    try:
        for wanted in ((True, True, True), (True, False, True), (False, True, False),
                       (False, True, True), (True, False, False)):  # (x, w0, w1) requiring grads
            leaves = [(shard(x, 1) if sp else x).clone(), *(shard(w, 0).clone() for w in ws)]
            for t, w in zip(leaves, wanted, strict=True):
                t.requires_grad_(w)
            ys = op(leaves[0], leaves[1:], **kw)
            with torch.profiler.profile() as prof:
                torch.autograd.backward(ys, [shard(g, -1) for g in grads])
            names = [e.name for e in prof.events()]
            seen[wanted] = ([t.grad for t in leaves], sum(map(names.count, _PRODUCTS)),
                            sum(map(names.count, _COLLECTIVES)))
    finally:
        dynamo.reset()
    full, _, full_comm = seen[(True, True, True)]
    n = tp_size()
    for (need_x, *need_w), (got, products, comm) in seen.items():
        for g, want, needed in zip(got, full, (need_x, *need_w), strict=True):
            assert (g is None) if not needed else torch.equal(g, want), (need_x, need_w)
        assert products == (len(ws) if need_x else 0) + sum(need_w), (need_x, need_w, products)
        # without dx: no all-reduce (nor reduce-scatter); the SP shard is gathered again only
        # for a weight gradient
        regather = int(sp and any(need_w))
        want = (full_comm - int(sp) + regather if need_x else regather) if n > 1 else 0
        assert comm == want, (need_x, need_w, comm, want)
    if sp and not compiled:  # the plain SP path (column_linears: regathering_column) likewise
        bias = torch.randn(5)
        for wanted in ((True, True, True, True), (True, False, True, False),
                       (False, True, False, False), (False, False, False, True)):
            leaves = [shard(x, 1).clone(), *(shard(w, 0).clone() for w in ws), shard(bias, 0)]
            for t, w in zip(leaves, wanted, strict=True):
                t.requires_grad_(w)
            ys = column_linears(leaves[0], leaves[1:3], [None, leaves[3]], **kw)
            pairs = [(y, shard(g, -1)) for y, g in zip(ys, grads, strict=True) if y.requires_grad]
            with torch.profiler.profile() as prof:  # (at n=1, plain linears: some need nothing)
                torch.autograd.backward(*zip(*pairs, strict=True))
            names = [e.name for e in prof.events()]
            got = [t.grad for t in leaves]
            if wanted == (True, True, True, True):
                full = got
            need_x, *need_w, _ = wanted
            assert sum(map(names.count, _PRODUCTS)) == 2 * need_x + sum(need_w), wanted
            # the shard gathered again only for a weight gradient; dx reduce-scattered
            comm = sum(map(names.count, _COLLECTIVES))
            assert comm == (any(need_w) + need_x if n > 1 else 0), (wanted, comm)
            for g, want, needed in zip(got, full, wanted, strict=True):
                assert (g is None) if not needed else torch.equal(g, want), wanted
    if not sp:  # the row op likewise: dx and dW each only where wanted
        x_row, w_row, dy = torch.randn(2, 5, 7), torch.randn(4, 7), torch.randn(2, 5, 4)
        for wanted in ((True, True), (True, False), (False, True)):
            leaves = [shard(x_row, -1).clone(), shard(w_row, 1).clone()]
            for t, w in zip(leaves, wanted, strict=True):
                t.requires_grad_(w)
            y = (torch.compile(fused_row, backend="aot_eager", fullgraph=True)
                 if compiled else fused_row)(*leaves)
            with torch.profiler.profile() as prof:
                y.backward(dy)
            names = [e.name for e in prof.events()]
            assert sum(map(names.count, _PRODUCTS)) == sum(wanted), wanted
            assert [t.grad is not None for t in leaves] == list(wanted)
        dynamo.reset()
    return True


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("sp,compiled", [(False, False), (True, False), (False, True),
                                         (True, True)])
def test_fused_column_skips_what_needs_no_gradient(ranks, n, sp, compiled):
    """A frozen weight (fine-tuning) gets no weight-gradient matmul, and an input that needs no
    gradient (a frozen embedding's output) no input-gradient matmuls nor their collective, as
    the plain layers' autograd skips them; the rest is the full backward's, bit for bit. The
    plain SP column path and the row op (``fused_row``) skip their products likewise, and the
    SP path gathers the shard again only for a weight gradient."""
    assert all(ranks(n).run(_frozen_body, sp, compiled))


def _opcheck_body():
    from tensorpar.parallel.collectives import group_name
    from tensorpar.transformer.rotary import _rotary_table_op

    torch.manual_seed(0)
    dys = [torch.randn(2, 5, o, dtype=torch.bfloat16) for o in (7, 5)]
    x, ws = torch.randn(2, 5, 8, dtype=torch.bfloat16), [torch.randn(o, 8) for o in (7, 5)]
    # a LoRA adapter (rank 3) on the second output: A, B and z^T = A x^T as forward made them
    a, b = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    adapter = ([a], [b], torch.randn(3, 10, dtype=torch.bfloat16), [1], [0.5])
    for sizes, regather, need_dx, need, lora in (
            ([], False, True, [True, True], None),  # without SP
            ([], False, True, [False, False, True, True], (*adapter, True)),  # partial sums
            ([5], True, True, [False, True, True, False], (*adapter, False)),  # SP at n=1
            ([5], True, True, [True, True], None),  # SP at n=1
            ([5], False, False, [False, True], None),
            ([], False, True, [False, False], None)):
        torch.library.opcheck(torch.ops.tensorpar.column_backward.default,
                              (dys, x, [w.bfloat16() for w in ws], torch.float32, [2, 5, 8],
                               sizes, regather, group_name(None), need_dx, need,
                               *(lora or ([], [], None, [], [], False))))
    torch.library.opcheck(_rotary_table_op, (8, 3, 5, 10000.0, torch.device("cpu")))
    return True


def test_custom_ops_pass_torch_opcheck(ranks):
    """The compiled path's custom ops are what torch.compile assumes: schema, fake tensors
    (shapes, dtypes, strides: bf16 products with an fp32 input gradient) and AOT dispatch."""
    assert ranks(1).run(_opcheck_body)[0]
