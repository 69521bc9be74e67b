"""Per-rank helpers: run a dense module and its parallel twin, compare everything, count comms."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tensorpar.cli.compare import dense_shard, max_rel_error
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import tp_rank, tp_size

TOL = 1e-5


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL):
    err = max_rel_error(actual, expected)
    assert err <= tol, f"{name}: max relative error {err:.3e} > {tol:.0e} (rank {tp_rank()})"


def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's ``tensor_split`` shard of ``t`` along ``dim``."""
    return torch.tensor_split(t, tp_size(), dim)[tp_rank()]


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def compare_module(
    dense: torch.nn.Module,
    parallel: torch.nn.Module,
    x: torch.Tensor,
    in_shard: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    out_shard: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    input_grad: bool = True,
    zero_grads: tuple[str, ...] = (),
    tol: float = TOL,
    output_tol: float | None = None,
) -> dict:
    """Forward and backward through both; assert output, input grad and every grad shard agree.

    in_shard / out_shard map a dense input / output to this rank's piece of it. Returns the
    collectives counted in the parallel forward and backward. ``zero_grads`` names parameters
    whose true gradient is exactly zero (see ``assert_grads``). ``tol``: the largest relative
    error allowed (``assert_close``) for every tensor compared; ``output_tol``, the output's
    where it differs (0.0: bit for bit).
    """
    x_dense = leaf(x) if input_grad else x
    y = dense(x_dense)
    grad_y = torch.randn_like(y)  # same on every rank: the seed is shared
    y.backward(grad_y)
    x_tp = leaf(in_shard(x)) if input_grad else in_shard(x)
    with CollectiveCounter() as fwd:
        y_tp = parallel(x_tp)
    with CollectiveCounter() as bwd:
        y_tp.backward(out_shard(grad_y))
    assert_close("output", y_tp, out_shard(y), tol if output_tol is None else output_tol)
    if input_grad:
        assert_close("input grad", x_tp.grad, in_shard(x_dense.grad), tol)
    assert_grads(dense, parallel, zero_grads, tol)
    return {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}


def assert_grads(dense: torch.nn.Module, parallel: torch.nn.Module,
                 zero_grads: tuple[str, ...] = (), tol: float = TOL) -> None:
    """Every parameter gradient of ``parallel`` equals its slice of the dense gradient.

    For the names in ``zero_grads`` the exact gradient is zero (a key bias shifts every score of a
    softmax row by the same amount), so both sides are rounding noise and a relative error is
    meaningless: both must be zero to 1e-6 absolute instead (the largest measured, a key bias's
    in tests/core/test_blocks.py: 2.1e-7). The others: to ``tol`` relative (``assert_close``).
    """
    dense_params = dict(dense.named_parameters())
    names = [n for n, _ in parallel.named_parameters()]
    assert sorted(names) == sorted(dense_params), f"{names} vs {list(dense_params)}"
    for name, p in parallel.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        if name in zero_grads:
            ref = dense_params[name].grad
            assert p.grad.abs().max() < 1e-6 and ref.abs().max() < 1e-6, name
            continue
        assert_close(f"grad {name}", p.grad, dense_shard(dense_params[name].grad, p.tp_shard),
                     tol)


def counts_ok(results: list[dict], forward: dict, backward: dict) -> None:
    """Every rank issued exactly the expected collectives."""
    for rank, counts in enumerate(results):
        assert counts["forward"] == forward, f"rank {rank} forward {counts['forward']}"
        assert counts["backward"] == backward, f"rank {rank} backward {counts['backward']}"


_SOLO: dict = {}


def solo_group():
    """A one-rank process group of this rank: the single-device reference runs inside it.
    Collective to create (every rank calls it), cached per process."""
    if "group" not in _SOLO:
        import torch.distributed as dist

        _SOLO["group"] = dist.new_subgroups(group_size=1)[0]
    return _SOLO["group"]
