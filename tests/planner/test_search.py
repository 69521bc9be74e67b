"""The layout search (``tensorpar plan --devices``) against a brute force: every (tp, pp, dp)
whose product is the devices, planned one by one with ``plan_pipeline``, under the rules the
search states (tp within a node and dividing the query heads, the batch split over dp); the
search lists exactly those that fit, and ranks them by the step time it claims: the FLOPs per
device at the device's rate stretched by the bubble (P - 1) / (V·m), plus each group's bytes
sent per rank at the node's bandwidth inside a node and the network's across."""

import pytest

from tensorpar.planner import search
from tensorpar.planner.pipeline import plan_pipeline
from tensorpar.planner.search import search_layouts, step_flops
from tensorpar.planner.shapes import preset
from tensorpar.planner.step import Step

# (model, devices, batch, seq, device memory, flags); each with layouts that fit and others that
# do not (6, 1, 12 and 1 of 20 or so planned), the last with layouts refused (the batch of 4)
CASES = {
    "70b-64x80": ("llama-2-70b", 64, 64, 2048, 80e9, {}),
    "70b-64x80-virtual": ("llama-2-70b", 64, 64, 2048, 80e9, {"virtual": 2}),
    "7b-24x14-recompute": ("llama-2-7b", 24, 48, 2048, 14e9, {"recompute": "full"}),
    "7b-12x16-batch-4": ("llama-2-7b", 12, 4, 1024, 16e9, {}),
}


def _brute_force(step, devices, memory):
    """(tp, pp, dp) -> plan_pipeline's plan of ``step`` laid out so, for every layout of
    ``devices`` that fits."""
    found, shape, batch = {}, step.shape, step.batch
    for tp in range(1, devices + 1):
        for pp in range(1, devices + 1):
            if devices % (tp * pp):
                continue
            dp = devices // (tp * pp)
            if tp > search.GPUS_PER_NODE or shape.n_head % tp or batch % dp:
                continue
            try:
                p = plan_pipeline(step.replace(tp=tp, pp=pp, dp=dp, micro_batches=batch // dp,
                                               virtual=step.virtual if pp > 1 else 1), memory)
            except ValueError:
                continue
            if p["fits"]:
                found[tp, pp, dp] = p
    return found


def _claimed_seconds(step, devices, layout, p) -> float:
    """The step-time model the search states, from the plan's sends."""
    tp, pp, dp = layout
    m, v = p["micro_batches"], p["virtual"]
    compute = step_flops(step.shape, step.batch, step.seq, step.recompute) / devices \
        / search.DEVICE_FLOPS
    seconds = compute * (1 + (pp - 1) / (v * m))
    sends = max(p["comm"], key=lambda c: c["tp"] + c["pp"] + c["dp"])
    for group, span in (("tp", tp), ("dp", tp * dp), ("pp", tp * dp * pp)):
        inside = span <= search.GPUS_PER_NODE
        seconds += sends[group] / (search.NODE_BYTES_S if inside else search.NETWORK_BYTES_S)
    return seconds


@pytest.mark.parametrize("case", CASES)
def test_search_lists_exactly_the_layouts_that_fit_ranked_by_its_step_time(case):
    """The listed layouts are the brute force's fits, no more, no fewer; each one's peak and
    step time are those of its own plan and the stated model; the list is in that order."""
    name, devices, batch, seq, memory, flags = CASES[case]
    step = Step(preset(name), batch=batch, seq=seq, **flags)
    out = search_layouts(step, devices, memory)
    want = _brute_force(step, devices, memory)
    assert want, "the case should have fitting layouts"
    listed = [(r["tp"], r["pp"], r["dp"]) for r in out["layouts"]]
    assert sorted(listed) == sorted(want), (sorted(listed), sorted(want))
    seconds = []
    for r, layout in zip(out["layouts"], listed, strict=True):
        p = want[layout]
        assert (r["total"], r["bubble"], r["virtual"]) == (p["total"], p["bubble"], p["virtual"])
        claimed = _claimed_seconds(step, devices, layout, p)
        assert r["step_seconds"] == pytest.approx(claimed, rel=1e-12), (layout, r)
        seconds.append(claimed)
    assert seconds == sorted(seconds)


def test_nothing_fits_lists_nothing_and_names_the_smallest():
    """With too little memory the brute force finds no fit, the search lists none and names
    the layout of the smallest peak among all it planned."""
    step = Step(preset("llama-2-70b"), batch=8, seq=2048)
    out = search_layouts(step, 8, 24e9)
    assert _brute_force(step, 8, 24e9) == {} and out["layouts"] == []
    totals = []
    for tp in (1, 2, 4, 8):
        for dp in (d for d in (1, 2, 4, 8) if (8 // tp) % d == 0):
            try:
                totals.append(plan_pipeline(step.replace(tp=tp, pp=8 // tp // dp, dp=dp,
                                                         micro_batches=8 // dp), 24e9)["total"])
            except ValueError:
                continue
    assert out["smallest"]["total"] == min(totals)
