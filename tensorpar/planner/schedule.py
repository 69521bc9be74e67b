"""Pipeline schedules, replayed: the order in which a pipeline rank runs its forwards and
backwards under torch's ``Schedule1F1B`` and ``ScheduleInterleaved1F1B``, the bubble, and the
largest moment of a rank's step along that order.

**Bubble** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", sections 2.2.1-2.2.2): the idle time of a step over its ideal time,
(P - 1) / m under 1F1B, (P - 1) / (V·m) interleaved (each rank's V stages are V times shorter).

**Activations in flight.** 1F1B runs P - k forwards on rank k before its first backward (torch's
warmup), so rank 0 holds P micro-batches' activations of its L/P blocks, rank P - 1 one.
Interleaved, torch 2.13 warms rank k up with (V - 1)·r + 2·(P - 1 - k) forwards of a stage
(r = m / max(1, m // P) micro-batches per round, P when P divides m), then runs one more before
its first backward: rank 0 holds P·V + P - 1 stage micro-batches of L/(P·V) blocks each, that is
P·(1 + (P - 1)/(P·V)) micro-batches of its L/P blocks, more than 1F1B's P (interleaving does not
reduce activation memory: the paper, section 2.2.2; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.3, gives the same factor
1 + (P - 1)/(P·V) for the first stage). ``schedule_ops`` replays torch's order forward by
backward (``tests/planner/test_pipeline_plan.py`` compares it with torch's own), and
``replay_peak`` finds the largest moment of that replay (``pipeline.rank_memory``).
"""

from __future__ import annotations


def bubble(pp: int, virtual: int, micro_batches: int) -> float:
    """The pipeline bubble, idle over ideal time: (P - 1) / (V·m) (Narayanan et al. 2021)."""
    return (pp - 1) / (virtual * micro_batches)


def schedule_ops(pp: int, virtual: int, micro_batches: int, rank: int) -> list[tuple[str, int]]:
    """The forwards ("F") and backwards ("B") pipeline rank ``rank`` runs in a step, in order,
    each with its local stage (0 .. V-1), as torch 2.13 orders them: ``Schedule1F1B`` (V = 1)
    warms up with min(m, P - rank) forwards, then runs a backward and a forward in turn;
    ``ScheduleInterleaved1F1B`` warms up with (V - 1)·r + 2·(P - 1 - rank) forwards (at most
    V·m; r micro-batches per round), then a forward and a backward in turn, forwards visiting its
    stages r micro-batches at a time in order, backwards in reverse."""
    m, v = micro_batches, virtual
    if v == 1:
        warmup = min(m, pp - rank)
        ops = [("F", 0)] * warmup
        for i in range(m):
            ops.append(("B", 0))
            if warmup + i < m:
                ops.append(("F", 0))
        return ops
    per_round = m // max(1, m // pp)
    total = v * m
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def forward(k):
        return ("F", (k // per_round) % v)

    def backward(j):
        return ("B", v - 1 - (j // per_round) % v)

    ops = [forward(k) for k in range(warmup)]
    for j in range(total - warmup):
        ops += [forward(warmup + j), backward(j)]
    return ops + [backward(j) for j in range(total - warmup, total)]


def replay_peak(ops: list[tuple[str, int]], acts: list[int], grads: list[int],
                temporaries: list[int]) -> dict:
    """The largest moment of a rank's schedule (``schedule_ops``): after each forward, the
    activations of the micro-batches in flight (``acts``: one micro-batch's, per local stage)
    and the gradients of every stage that has begun a backward (``grads``: they accumulate to
    the end of the step); at each backward, its stage's gradients too and the backward's
    ``temporaries``. Returns "bytes", "op" and "stage" (local) of that moment, "in_flight"
    (micro-batches per local stage) and "activations" then."""
    in_flight, started = [0] * len(acts), set()
    best = {"bytes": -1}
    for op, c in ops:
        if op == "F":
            in_flight[c] += 1
        else:
            started.add(c)
        held = sum(n * a for n, a in zip(in_flight, acts, strict=True))
        now = held + sum(grads[d] for d in started) + (temporaries[c] if op == "B" else 0)
        if now > best["bytes"]:
            best = {"bytes": now, "op": "forward" if op == "F" else "backward", "stage": c,
                    "in_flight": list(in_flight), "activations": held}
        if op == "B":
            in_flight[c] -= 1
    return best
