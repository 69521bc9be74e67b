"""The flags of ``tensorpar plan`` that describe the layout of ranks (dp, cp, ep, pp, the
``--devices`` search), the kernels and the device, and the outputs (``cli/plan.py`` adds the
model's and the step's shape)."""

from __future__ import annotations

import argparse

from tensorpar.planner.activations import DEVICES
from tensorpar.planner.step import ADAMW


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the layout of ranks (dp, cp, ep, pp, the search), the kernels and the
    device, and the outputs."""
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel copies of the TP-split model (the world is TP x DP "
                   "ranks); 1 is none (default: a run's, else 1)")
    p.add_argument("--cp", type=int, default=None,
                   help="context parallelism: each sequence split over --cp ranks (2 "
                   "load-balanced chunks each; K and V all-gathered in attention), the world "
                   "tp x cp x dp x pp ranks; a rank keeps its tokens' activations, the whole "
                   "sequence's K and V and its queries' mask against every key (default 1; "
                   "--devices searches it when no layout fits at cp 1, or tries only this one)")
    p.add_argument("--ep", type=int, default=1, help="an MoE model's routed experts split over "
                   "--ep of the dp x tp ranks (default 1; --devices searches it)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages: the blocks cut into --pp stages over as many ranks "
                   "(tp x dp x pp ranks), run by 1F1B on --micro-batches; plans one layout, "
                   "a row per pipeline rank (default: no pipeline; with --devices the only "
                   "pipeline size the search tries)")
    p.add_argument("--pp-virtual", type=int, default=None,
                   help="stages per pipeline rank, interleaved 1F1B (stage s on pp rank s %% "
                   "pp): a bubble V times smaller, V times the point-to-point sends (default: a "
                   "run's, else 1)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="how many micro-batches per step and data-parallel copy (gradient "
                   "accumulation's passes: --batch-size / (--dp x --micro-batch-size)) "
                   "(default: one sequence each; without --batch-size, 2 x --pp of them)")
    p.add_argument("--devices", type=int, default=None,
                   help="search the (tp, pp, dp) layouts of this many devices for those that "
                   "fit --device-memory, ranked by an estimated step time; --batch is the "
                   "step's (default: one sequence per device) (default: no search)")
    p.add_argument("--dp-mode", default=None,
                   help="how the copies share: fsdp (FSDP2, weights, gradients and AdamW states "
                   "sharded over the copies, each block gathered for its forward and backward) "
                   "or ddp (DDP, replicated, gradients all-reduced in buckets) (default: a run's, "
                   "else fsdp)")
    p.add_argument("--optimizer", choices=ADAMW, default="fused",
                   help="AdamW's implementation: fused (tensorpar's trainer) steps in place; "
                   "foreach (torch's default on cuda) keeps an fp32 temporary per parameter, "
                   "for-loop (torch's default on cpu) two of the largest (default fused)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the step runs: cuda counts what torch's CUDA kernels keep for "
                   "backward (RMSNorm's fused kernel keeps no normalized copy; the attention "
                   "output is read by the output projection as it is), cpu what its CPU "
                   "kernels keep (default cpu)")
    p.add_argument("--device-memory", default="80GB",
                   help="memory per device, with its unit: GB and MB are decimal (80GB = 80e9 "
                   "bytes, an H100's 80 GB), GiB and MiB binary (24GiB = 24 x 2^30); plan "
                   "prints binary units, as train does (80GB shows as 74.5 GiB) (default 80GB)")
    p.add_argument("--reserve", type=float, default=0.10,
                   help="fraction of device memory kept free for fragmentation, the CUDA "
                   "context and buffers, from 0 up to 1 (default 0.1)")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of tables (default: tables)")
    p.add_argument("--png", metavar="FILE",
                   help="also write a chart to FILE: per-rank memory by component against TP "
                   "size (default: no chart)")
    p.add_argument("--split", action="store_true",
                   help="also compare the ways of splitting gelu(X W1) W2, by bytes moved "
                   "(default off)")
