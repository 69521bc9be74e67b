"""What tensorpar's GPT saves for backward, tensor by tensor, next to what the planner counts.

Builds the GPT at TP=1 in this process (no torch.distributed), runs one forward and loss under
``torch.autograd.graph.saved_tensors_hooks`` and prints, per block and for the rest of the model,
every distinct saved storage (each counted once, however many saved tensors view it), grouped as
``count x shape dtype bytes  module: autograd nodes``, with the block's total next to the
planner's terms (``tensorpar/planner/memory.py``). Then the measured memory of one forward and
backward (no optimizer step): on CUDA the caching allocator's statistics, on CPU ``MemoryMeter``.

::

    python benchmarks/saved_activations.py                      # CPU, d=256, 2 layers, B2 x T256
    python benchmarks/saved_activations.py --device cuda --dim 2048 --n-layer 2 --n-head 16 \\
        --n-kv-head 4 --batch 8 --seq 2048                       # the H100 shape of issue 15

Modes (``--modes``, default ``fp32,bf16,bf16-unfused``): fp32, bf16 (autocast), each with the
fused column ops, ``-unfused`` (``GPT(fused=False)``) or ``-recompute`` (full recomputation: the
memory only, since the checkpoint's own hooks take the saved tensors). ``--step`` also measures a
whole training step (AdamW too) against the planner's total, as ``tensorpar train`` reports it;
``--sdpa`` forces one attention kernel. Needs torch and the repo only.

Measured on an H100 (torch 2.11, issue 15; d=2048, 16 layers, 16/4 heads, B8 x T2048, ``--step``):
whole step fp32 46.19 GiB, planned +1.0%; bf16 31.56 GiB, +0.8%; bf16 unfused 34.56, +0.7%; bf16
recomputed 12.36, -0.8% (``device="cuda"``; with the CPU counts the planner was 13-14% over).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar.gpt.model import GPT, GPTConfig  # noqa: E402
from tensorpar.planner import memory as plan  # noqa: E402
from tensorpar.planner.activations import block_terms  # noqa: E402
from tensorpar.planner.meter import MemoryMeter  # noqa: E402
from tensorpar.planner.step import Step  # noqa: E402
from tensorpar.train.shape import gpt_shape  # noqa: E402

MODES = ("fp32", "bf16", "fp32-unfused", "bf16-unfused", "fp32-recompute", "bf16-recompute")
SDPA = ("auto", "flash", "efficient", "cudnn", "math")
MiB = 2 ** 20


def mib(n: float) -> str:
    return f"{n / MiB:9.2f} MiB"


def short_dtype(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class SavedRecorder:
    """pack hook: notes every saved tensor's storage, shape, dtype and the module running."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = ["<top>"]
        self.inputs: list[set[int]] = [set()]
        self.records: dict[int, dict] = {}  # storage data_ptr -> record
        self.handles = []
        for name, mod in model.named_modules():
            if not name:
                continue
            self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self.handles.append(mod.register_forward_hook(self._post()))

    def _pre(self, name):
        def hook(_mod, args):
            self.stack.append(name)
            self.inputs.append({a.untyped_storage().data_ptr() for a in args
                                if isinstance(a, torch.Tensor)})
        return hook

    def _post(self):
        def hook(_mod, _args, _out):
            self.stack.pop()
            self.inputs.pop()
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()

    def pack(self, t: torch.Tensor):
        if t.device.type != "meta":
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.records:
                view = t._base is not None or st.nbytes() != t.numel() * t.element_size()
                self.records[ptr] = {
                    "module": self.stack[-1], "shape": tuple(t.shape),
                    "dtype": short_dtype(t.dtype), "bytes": st.nbytes(), "view": view,
                    "input": ptr in self.inputs[-1], "param": isinstance(t, torch.nn.Parameter),
                    "nodes": set(), "order": len(self.records)}
        return t

    @staticmethod
    def unpack(t):
        return t


def annotate_nodes(loss: torch.Tensor, records: dict[int, dict]) -> None:
    """Walk the autograd graph; name each storage by the nodes (and fields) that saved it."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node.name()
        saved: list[tuple[str, object]] = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    saved.append((attr[7:], getattr(node, attr)))
                except Exception:  # noqa: BLE001 - a field that cannot be read back
                    pass
        if hasattr(node, "saved_tensors") and not saved:  # a custom autograd.Function
            try:
                saved += [(f"saved[{i}]", t) for i, t in enumerate(node.saved_tensors)]
            except Exception:  # noqa: BLE001
                pass
        for field, value in saved:
            values = value if isinstance(value, (tuple, list)) else [value]
            for v in values:
                if isinstance(v, torch.Tensor) and v.device.type != "meta":
                    rec = records.get(v.untyped_storage().data_ptr())
                    if rec is not None:
                        short = name.replace("Backward0", "").replace("Backward", "")
                        rec["nodes"].add(f"{short}.{field}")
        todo.extend(fn for fn, _ in node.next_functions)


def kind_of(rec: dict, model_param_ptrs: set[int]) -> str:
    """'param' (an fp32 parameter saved as it is), 'wcopy' (autocast's bf16 copy of a weight:
    the planner counts it in the weights' copies), else 'act'."""
    if rec["param"] or rec["ptr"] in model_param_ptrs:
        return "param"
    if rec["module"] == "<top>" and len(rec["shape"]) == 2 and rec["dtype"] == "bfloat16" \
            and "weight" in " ".join(rec["nodes"]).lower():
        return "wcopy"
    return "act"


def block_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "blocks" and len(parts) > 1:
        return f"blocks.{parts[1]}"
    return parts[0]


def capture(model, ids, autocast_ctx):
    rec = SavedRecorder(model)
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), autocast_ctx():
            loss = model(ids, ids)
    finally:
        rec.remove()
    annotate_nodes(loss, rec.records)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}  # the unfused linears save the transposed copy
    for ptr, r in rec.records.items():
        r["ptr"] = ptr
        r["kind"] = kind_of(r, params)
        if r["kind"] == "act" and r["dtype"] == "bfloat16" and r["shape"] in shapes:
            r["kind"] = "wcopy"
    loss.backward()  # frees the graph
    del loss
    return list(rec.records.values())


def measure(model, ids, autocast_ctx, device: str) -> dict:
    """Bytes above the weights after forward and at the peak of forward + backward."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    with MemoryMeter(device) as mem:
        with autocast_ctx():
            loss = model(ids, ids)
        if device == "cuda":
            torch.cuda.synchronize()
            after_fwd = torch.cuda.memory_allocated() - mem.entry_bytes
        else:
            tracker = getattr(mem, "_tracker", None)
            after_fwd = tracker.live_bytes - mem.entry_bytes if tracker is not None else -1
        loss.backward()
        del loss
    out = {"entry": mem.entry_bytes, "after_forward": after_fwd,
           "peak": mem.peak_bytes - mem.entry_bytes}
    model.zero_grad(set_to_none=True)
    return out


def measure_step(model, ids, autocast_ctx, device: str, shape, args, bf16, fused,
                 recompute) -> str:
    """The trainer's step (forward, backward, gradient clipping, fused AdamW, zero_grad), twice;
    the second under MemoryMeter, against the planner's total (what ``tensorpar train`` prints
    as planned against measured)."""
    from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
    from tensorpar.train.optim import adamw, implementation
    ownership = ShardOwnership.gather(model)
    opt = adamw(model.parameters(), lr=1e-4)
    for _ in range(2):
        with MemoryMeter(device) as mem:
            with autocast_ctx():
                loss = model(ids, ids)
            loss.backward()
            del loss
            clip_grad_norm_(model, ownership, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    kind = implementation(opt)
    attention = args.sdpa if args.sdpa in ("flash", "efficient", "cudnn") and device == "cuda" \
        else None
    planned = plan.tensorpar_memory(Step(shape, 1, args.batch, args.seq,
                                         "bf16-autocast" if bf16 else "fp32",
                                         recompute="full" if recompute else "none", fused=fused,
                                         optimizer=kind, device=device, attention=attention))
    del opt, ownership
    model.zero_grad(set_to_none=True)
    return (f"-- training step (AdamW {kind}, as tensorpar train): measured peak "
            f"{mib(mem.peak_bytes)}; planned {mib(planned.total)} at {planned.peak_at} "
            f"({planned.total / mem.peak_bytes - 1:+.1%})")


def planner_terms(shape, B: int, T: int, bf16: bool, fused: bool, recompute: bool, device: str,
                  sdpa: str) -> dict:
    """The planner's per-block terms (activations.block_terms), and its whole-model activations
    and peaks (no optimizer)."""
    attention = sdpa if sdpa in ("flash", "efficient", "cudnn") and device == "cuda" else None
    step = Step(shape, 1, B, T, "bf16-autocast" if bf16 else "fp32",
                recompute="full" if recompute else "none", fused=fused, device=device,
                attention=attention)
    terms = block_terms(step)
    mem = plan.tensorpar_memory(step)
    return {"block": terms, "mem": mem}


def sdpa_context(name: str):
    """Forces one SDPA kernel (torch.nn.attention.sdpa_kernel), or nothing for "auto"."""
    if name == "auto":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]
    return sdpa_kernel([backend])


def print_group(title: str, recs: list[dict], indent: str = "  ") -> None:
    groups: dict[tuple, list] = defaultdict(list)
    for r in recs:
        key = (r["module"], r["kind"], r["shape"], r["dtype"], r["bytes"], r["view"],
               r["input"], tuple(sorted(r["nodes"])))
        groups[key].append(r)
    print(f"{title}")
    for key in sorted(groups, key=lambda k: min(r["order"] for r in groups[k])):
        module, kind, shape, dtype, nbytes, view, is_input, nodes = key
        n = len(groups[key])
        tags = [t for t, on in (("view", view), ("module input", is_input)) if on]
        if kind != "act":
            tags.append(kind)
        shape_s = "x".join(str(d) for d in shape) or "scalar"
        print(f"{indent}{n:2d} x {shape_s:>20} {dtype:8} {mib(n * nbytes)}  {module}: "
              f"{', '.join(nodes) or '?'}{'  [' + ', '.join(tags) + ']' if tags else ''}")


def run_mode(mode: str, args) -> None:
    bf16, fused = mode.startswith("bf16"), not mode.endswith("-unfused")
    recompute = mode.endswith("-recompute")
    device = args.device
    cfg = GPTConfig(vocab_size=args.vocab_size, n_layer=args.n_layer, dim=args.dim,
                    n_head=args.n_head, n_kv_head=args.n_kv_head, hidden_dim=args.hidden_dim,
                    tie_embeddings=not args.untied)
    torch.manual_seed(0)
    model = GPT(cfg, None, False, seed=0, device=device, fused=fused, recompute=recompute)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)

    @contextmanager
    def autocast_ctx():
        with sdpa_context(args.sdpa), \
                (torch.autocast(device, torch.bfloat16) if bf16 else nullcontext()):
            yield

    shape = gpt_shape(cfg)
    print(f"\n=== {mode} on {device}: d={cfg.dim} L={cfg.n_layer} heads {cfg.n_head}/"
          f"{cfg.n_kv_head} hidden {cfg.hidden_dim} vocab {cfg.vocab_size} B{args.batch} x "
          f"T{args.seq} (N={args.batch * args.seq} tokens); sdpa {args.sdpa}")
    t0 = time.perf_counter()
    # warm up (CUDA: cuBLAS workspaces, kernels), then measure without hooks, then capture
    with autocast_ctx():
        model(ids, ids).backward()
    model.zero_grad(set_to_none=True)
    measured = measure(model, ids, autocast_ctx, device)
    step_line = measure_step(model, ids, autocast_ctx, device, shape, args, bf16, fused,
                             recompute) if args.step else None
    pl = planner_terms(shape, args.batch, args.seq, bf16, fused, recompute, device, args.sdpa)
    mem = pl["mem"]
    # forward + backward: the loss's or a block's backward, or all gradients at the end
    peaks = {k: v for k, v in mem.peaks.items() if k != "optimizer step"}
    peaks["gradients"] = mem.grads
    plan_peak = max(peaks.values())
    measured_line = (
        f"-- measured ({'CUDA allocator' if device == 'cuda' else 'MemoryMeter'}): weights "
        f"{mib(measured['entry'])}; after forward +{mib(measured['after_forward'])}; peak of "
        f"forward+backward +{mib(measured['peak'])}\n"
        f"   planner: activations {mib(mem.activations)}; peak (no optimizer) "
        f"+{mib(plan_peak)} at {max(peaks, key=peaks.get)} "
        f"({plan_peak / measured['peak'] - 1:+.1%}); "
        + ", ".join(f"{k} {v / MiB:.1f}" for k, v in peaks.items()) + " MiB")
    if step_line:
        measured_line += "\n" + step_line
    if recompute:  # checkpoint's own hooks take the saved tensors: only the memory is shown
        print(measured_line)
        print(f"   ({time.perf_counter() - t0:.1f} s)")
        return
    recs = capture(model, ids, autocast_ctx)
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        sdp = [f"{k}={getattr(torch.backends.cuda, k + '_sdp_enabled')()}"
               for k in ("flash", "mem_efficient", "math", "cudnn")
               if hasattr(torch.backends.cuda, k + "_sdp_enabled")]
        print(f"  sdpa backends enabled: {' '.join(sdp)}")

    by_part: dict[str, list] = defaultdict(list)
    for r in recs:
        by_part[block_of(r["module"])].append(r)
    terms = pl["block"]
    plan_total = terms.get("total", sum(v for k, v in terms.items() if k != "total"))
    parts = sorted(by_part, key=lambda p: min(r["order"] for r in by_part[p]))
    totals = {}
    for part in parts:
        rs = by_part[part]
        act = sum(r["bytes"] for r in rs if r["kind"] == "act")
        wcopy = sum(r["bytes"] for r in rs if r["kind"] == "wcopy")
        totals[part] = (act, wcopy)
        if part.startswith("blocks.") and part != "blocks.0" and not args.all_blocks:
            continue
        print_group(f"-- {part}: saved activations {mib(act)}"
                    + (f" + bf16 weight copies {mib(wcopy)}" if wcopy else "")
                    + (f" + parameters {mib(sum(r['bytes'] for r in rs if r['kind'] == 'param'))}"
                       if any(r["kind"] == "param" for r in rs) else ""), rs)
    blocks = [p for p in parts if p.startswith("blocks.")]
    print("-- per block (saved storages first saved inside it; block i's input counts in "
          "block i-1 or embed):")
    for p in blocks:
        act, wcopy = totals[p]
        print(f"  {p:10} activations {mib(act)}  + weight copies {mib(wcopy)}  = "
              f"{mib(act + wcopy)}")
    print(f"  planner per block: {mib(plan_total)}  terms: " + ", ".join(
        f"{k} {v / MiB:.2f}" for k, v in terms.items() if k != "total") + " (MiB)")
    mid = blocks[1:-1] or blocks
    if mid:
        got = sum(sum(totals[p]) for p in mid) / len(mid)
        print(f"  middle blocks' mean {mib(got)}; planner - measured {mib(plan_total - got)} "
              f"({plan_total / got - 1:+.1%})")
    all_saved = sum(a + w for a, w in totals.values())
    print(f"-- whole model: saved (activations + copies) {mib(all_saved)}; planner "
          f"activations {mib(mem.activations)} ({mem.activations / all_saved - 1:+.1%})")
    print(measured_line)
    print(f"   ({time.perf_counter() - t0:.1f} s)")
    del model, recs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--hidden-dim", type=int, default=0, help="0: GPTConfig's default")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--untied", action="store_true", help="an LM head of its own")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--modes", default="fp32,bf16,bf16-unfused",
                   help=f"comma-separated, of {', '.join(MODES)} (default fp32,bf16,bf16-unfused)")
    p.add_argument("--sdpa", choices=SDPA, default="auto",
                   help="force one attention kernel (default auto: torch's choice)")
    p.add_argument("--step", action="store_true",
                   help="also measure a whole training step (AdamW too) against the planner's "
                   "total, as tensorpar train reports it")
    p.add_argument("--all-blocks", action="store_true",
                   help="list every block's tensors (default: blocks.0 only, totals for all)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; expected {MODES}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    print(f"torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
          + f"; threads {torch.get_num_threads()}")
    for mode in modes:
        run_mode(mode, args)


if __name__ == "__main__":
    main()
