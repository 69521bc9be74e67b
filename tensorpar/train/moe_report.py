"""The summary's rows of a Mixture-of-Experts run: the aux loss, each MoE layer's expert load,
and the measured step's expert-parallel collectives beside ``planner/moe_comm.py``'s count
(calls exactly; bytes as measured beside the even-routing expectation: routing decides them)."""

from __future__ import annotations

from rich.table import Table

from tensorpar.planner.moe_comm import expected_calls, moe_comm
from tensorpar.planner.step import Step
from tensorpar.runtime.output import human_bytes


def moe_rows(table: Table, rows: list[dict], comm: dict, step: Step) -> None:
    """Add the MoE rows (nothing for a dense model or a run without steps)."""
    done = [r for r in rows if r.get("aux_loss") is not None]
    if step.shape.moe is None or not done:
        return
    table.add_row("MoE aux loss (first -> final step)",
                  f"{done[0]['aux_loss']:.5f} -> {done[-1]['aux_loss']:.5f} (the balancing "
                  "and z-losses times their coefficients, summed over the layers)")
    loads = done[-1].get("expert_load") or []
    table.add_row("expert load (final step, tokens)",
                  "; ".join(f"block {i}: {lo}-{hi}" for i, (lo, hi) in enumerate(loads))
                  + " (fewest-most routed to one expert)")
    want = expected_calls(step)
    predicted = moe_comm(step)
    for label, kind in (("ep", "all_to_all"), ("stats", "all_reduce")):
        if not want.get(kind):
            continue
        got = comm.get(label, {})
        calls = got.get("counts", {}).get(kind, 0)
        verdict = "as counted" if calls == want[kind] else f"analytic count {want[kind]}"
        what = "EP all_to_all" if label == "ep" else "router statistics all_reduce"
        table.add_row(f"{what} per step",
                      f"{calls} calls ({verdict}), {human_bytes(got.get('bytes', {}).get(kind, 0))}"
                      f" payload (even routing: {human_bytes(predicted['bytes'].get(kind, 0))})")
