"""Draw the docs' figures (learn.md, moe.md, context-parallel.md): `python docs/figures/draw.py
[DIR]` writes docs/figures/*.png (or into DIR; tests/test_docs.py draws them again, compares).

Deterministic: no dates, no random numbers, no software version in the files. Every figure is
7 inches wide (700 px at 100 dpi, saved at 200 dpi) and drawn in inches: the axes span the figure.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
RANK = ["#4C72B0", "#DD8452"]        # rank 0 blue, rank 1 orange
LIGHT = ["#C6D4EA", "#F5D2B8"]       # the same, lighter: partial results
GREY, INK, COMM = "#D5D5D5", "#222222", "#7B4EA3"  # replicated data, text, collectives
plt.rcParams.update({"font.family": "DejaVu Sans", "font.size": 11})


def canvas(w, h):
    """A figure w x h inches whose data coordinates are inches (origin bottom left)."""
    fig = plt.figure(figsize=(w, h))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.axis("off")
    return fig, ax


def save(fig, name):
    fig.savefig(OUT / name, dpi=200, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {OUT / name}")


def grid(ax, x, top, rows, cols, cell, color):
    """A matrix of rows x cols cells, top-left corner at (x, top); color(i, j) fills cell i, j."""
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((x + j * cell, top - (i + 1) * cell), cell, cell,
                                   facecolor=color(i, j), edgecolor="white", lw=1.2))
    ax.add_patch(Rectangle((x, top - rows * cell), cols * cell, rows * cell, fill=False,
                           edgecolor=INK, lw=1))


def box(ax, x, y, w, h, text, face, edge=INK, color=INK, size=10.5, weight="normal"):
    """A rounded box with centred text; (x, y) is the bottom-left corner."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.07",
                                facecolor=face, edgecolor=edge, lw=1.2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=color,
            weight=weight)


def arrow(ax, x0, y0, x1, y1, color=INK, lw=1.3, style="-|>"):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=12,
                                 color=color, lw=lw, shrinkA=0, shrinkB=0))


def text(ax, x, y, s, size=10.5, color=INK, ha="center", va="center", **kw):
    ax.text(x, y, s, fontsize=size, color=color, ha=ha, va=va, **kw)


def legend(ax, x, y):
    for r in range(2):
        ax.add_patch(Rectangle((x + r * 1.05, y - 0.07), 0.14, 0.14, facecolor=RANK[r]))
        text(ax, x + r * 1.05 + 0.2, y, f"rank {r}", ha="left", size=10)


def column_split():
    """(a) Y = X W, W's output features (columns) split: each rank computes its columns of Y."""
    fig, ax = canvas(7, 3.3)
    c, mid = 0.3, 1.95
    text(ax, 3.5, 3.1, "Column split: each rank holds some of W's columns (output features)",
         size=12, weight="bold")
    grid(ax, 0.35, mid + 1.5 * c, 3, 4, c, lambda i, j: GREY)                 # X: 3 x 4
    grid(ax, 2.2, mid + 2 * c, 4, 6, c, lambda i, j: RANK[j // 3])            # W: 4 x 6
    grid(ax, 4.75, mid + 1.5 * c, 3, 6, c, lambda i, j: RANK[j // 3])         # Y: 3 x 6
    text(ax, 1.85, mid, "×", size=18)
    text(ax, 4.38, mid, "=", size=18)
    text(ax, 0.95, mid + 1.5 * c + 0.22, "X  (tokens × in)", size=10.5)
    text(ax, 3.1, mid + 2 * c + 0.22, "W  (in × out)", size=10.5)
    text(ax, 5.65, mid + 1.5 * c + 0.22, "Y = X W  (tokens × out)", size=10.5)
    text(ax, 0.95, mid - 1.5 * c - 0.2, "the same on every rank", size=9.5)
    for r in range(2):
        text(ax, 2.2 + (1.5 + 3 * r) * c, mid - 2 * c - 0.2, f"W$_{r}$", color=RANK[r], size=11,
             weight="bold")
        text(ax, 4.75 + (1.5 + 3 * r) * c, mid - 1.5 * c - 0.2, f"Y$_{r}$", color=RANK[r],
             size=11, weight="bold")
    text(ax, 0.35, 0.72, "rank 0 computes Y$_0$ = X W$_0$,  rank 1 computes Y$_1$ = X W$_1$: "
         "no communication.", ha="left")
    text(ax, 0.35, 0.42, "Y = [Y$_0$  Y$_1$] needs an all-gather, if anything needs all of Y.",
         ha="left")
    text(ax, 0.35, 0.14, "(nn.Linear stores W transposed, weight (out, in): a column split "
         "cuts its rows.)", ha="left", size=9.5, color="#555555")
    legend(ax, 4.9, 0.42)
    save(fig, "col_split.png")


def row_split():
    """(b) W's input features (rows) split: partial sums, then an all-reduce."""
    fig, ax = canvas(7, 4.3)
    c, top_mid, bot_mid = 0.22, 2.95, 1.2
    text(ax, 3.5, 4.1, "Row split: each rank holds some of W's rows (input features)", size=12,
         weight="bold")
    grid(ax, 0.6, top_mid + 1.5 * c, 3, 6, c, lambda i, j: RANK[j // 3])      # X: 3 x 6
    grid(ax, 2.6, top_mid + 3 * c, 6, 4, c, lambda i, j: RANK[i // 3])        # W: 6 x 4
    text(ax, 2.27, top_mid, "×", size=16)
    text(ax, 0.6 + 3 * c, top_mid + 1.5 * c + 0.2, "X  (tokens × in)", size=10.5)
    text(ax, 2.6 + 2 * c, top_mid + 3 * c + 0.2, "W  (in × out)", size=10.5)
    for r in range(2):
        text(ax, 0.6 + (1.5 + 3 * r) * c, top_mid - 1.5 * c - 0.17, f"X$_{r}$",
             color=RANK[r], weight="bold")
        text(ax, 2.6 + 4 * c + 0.12, top_mid + (1.5 - 3 * r) * c, f"W$_{r}$", color=RANK[r],
             weight="bold", ha="left")
    text(ax, 3.95, top_mid + 0.12, "rank r multiplies X$_r$ by W$_r$:", ha="left", size=10)
    text(ax, 3.95, top_mid - 0.15, "a partial sum of the whole Y", ha="left", size=10)
    for r, x in enumerate((0.6, 2.05)):                                       # partial sums
        grid(ax, x, bot_mid + 1.5 * c, 3, 4, c, lambda i, j, r=r: LIGHT[r])
        text(ax, x + 2 * c, bot_mid + 1.5 * c + 0.18, f"P$_{r}$ = X$_{r}$ W$_{r}$",
             color=RANK[r], weight="bold")
    text(ax, 1.77, bot_mid, "+", size=16)
    arrow(ax, 3.1, bot_mid, 4.05, bot_mid, color=COMM, lw=2)
    text(ax, 3.57, bot_mid + 0.25, "all-reduce", color=COMM, size=10.5, weight="bold")
    text(ax, 3.57, bot_mid - 0.22, "(sum)", color=COMM, size=10)
    grid(ax, 4.2, bot_mid + 1.5 * c, 3, 4, c, lambda i, j: GREY)
    text(ax, 5.2, bot_mid + 0.12, "Y = P$_0$ + P$_1$ + b", ha="left")
    text(ax, 5.2, bot_mid - 0.17, "on every rank", ha="left", size=10)
    text(ax, 0.3, 0.45, "One all-reduce adds the partial sums; the bias is added once, after it.",
         ha="left")
    text(ax, 0.3, 0.15, "(nn.Linear's weight is (out, in): a row split of W cuts its columns.)",
         ha="left", size=9.5, color="#555555")
    legend(ax, 4.9, 3.75)
    save(fig, "row_split.png")


def mlp():
    """(c) Column -> activation -> row, with f and g where the collectives run."""
    fig, ax = canvas(7, 3.9)
    text(ax, 3.5, 3.7, "The MLP: column, activation, row; f and g are the only communication",
         size=12, weight="bold")
    lanes, h = (2.55, 1.45), 0.62
    box(ax, 0.15, 1.45, 0.6, 1.72, "X", GREY, size=12)
    box(ax, 6.35, 1.45, 0.5, 1.72, "Y", GREY, size=12)
    for name, x in (("f", 1.0), ("g", 5.72)):
        box(ax, x, 1.3, 0.4, 2.02, name, "#EADCF3", edge=COMM, color=COMM, size=15,
            weight="bold")
    for r, y in enumerate(lanes):
        arrow(ax, 0.75, y + h / 2, 1.0, y + h / 2)
        box(ax, 1.65, y, 1.25, h, f"X W$_{{\\mathrm{{up}},{r}}}$\ncolumn", RANK[r],
            color="white", size=10)
        arrow(ax, 1.4, y + h / 2, 1.65, y + h / 2)
        arrow(ax, 2.9, y + h / 2, 3.1, y + h / 2)
        box(ax, 3.1, y, 1.1, h, "GeLU\nor SwiGLU", LIGHT[r], size=10)
        arrow(ax, 4.2, y + h / 2, 4.4, y + h / 2)
        box(ax, 4.4, y, 1.1, h, f"h$_{r}$ W$_{{\\mathrm{{down}},{r}}}$\nrow", RANK[r],
            color="white", size=10)
        arrow(ax, 5.5, y + h / 2, 5.72, y + h / 2)
        arrow(ax, 6.12, y + h / 2, 6.35, y + h / 2)
        text(ax, 1.65, y + h + 0.12, f"rank {r}", size=9.5, color=RANK[r], ha="left",
             weight="bold")
    text(ax, 3.65, 1.2, "inside: no communication (hidden features split)", size=9.5,
         color="#555555")
    text(ax, 0.15, 0.72, "f: forward identity;  backward all-reduce (sums the ranks' parts of dX)",
         ha="left", color=COMM)
    text(ax, 0.15, 0.42, "g: forward all-reduce (sums the partial Ys);  backward identity",
         ha="left", color=COMM)
    text(ax, 0.15, 0.12, "One all-reduce in forward, one in backward (Shoeybi et al. 2019).",
         ha="left")
    save(fig, "mlp.png")


def attention():
    """(d) Heads split over ranks; GQA's shared KV heads."""
    fig, ax = canvas(7, 3.6)
    text(ax, 0.2, 3.42, "Attention split by heads", size=12, weight="bold", ha="left")
    s = 0.28

    def heads(x0, y, owners, gap=0.06, labels=None):
        centres = []
        for j, owner in enumerate(owners):
            x = x0 + j * (s + gap)
            ax.add_patch(Rectangle((x, y), s, s, facecolor=RANK[owner], edgecolor=INK, lw=0.8))
            text(ax, x + s / 2, y + s / 2, labels[j] if labels else str(j), size=9,
                 color="white", weight="bold")
            centres.append(x + s / 2)
        return centres

    # left: GQA, 8 query heads, 2 KV heads, over 2 ranks
    x0, step = 0.6, s + 0.05
    text(ax, 1.9, 3.0, "8 query heads, 2 KV heads (GQA)", size=10.5)
    q = heads(x0, 2.25, [0] * 4 + [1] * 4, gap=0.05)
    kv = heads(x0 + 1.5 * step, 1.1, [0, 1], gap=4 * step - s)
    for j, xq in enumerate(q):
        ax.plot([xq, kv[j // 4]], [2.25, 1.1 + s], color=RANK[j // 4], lw=1)
    text(ax, 0.45, 2.25 + s / 2, "q", ha="right", size=10.5)
    text(ax, 0.45, 1.1 + s / 2, "k, v", ha="right", size=10.5)
    text(ax, 1.9, 0.75, "each rank: 4 query heads and the", size=9.5)
    text(ax, 1.9, 0.5, "KV head they read; nothing shared", size=9.5)
    # right: 3 query heads, 1 KV head, over 2 ranks
    ax.plot([3.55, 3.55], [0.35, 3.15], color="#BBBBBB", lw=1)
    text(ax, 5.3, 3.05, "3 query heads, 1 KV head, 2 ranks", size=10.5)
    q = heads(4.45, 2.25, [0, 0, 1])
    kv = heads(4.25, 1.1, [0, 1], gap=0.85, labels=["0", "0"])
    for j, xq in enumerate(q):
        ax.plot([xq, kv[0 if j < 2 else 1]], [2.25, 1.1 + s], color=RANK[0 if j < 2 else 1],
                lw=1)
    arrow(ax, kv[0] + s / 2 + 0.05, 1.1 + s / 2, kv[1] - s / 2 - 0.05, 1.1 + s / 2,
          color=COMM, style="<|-|>")
    text(ax, 5.3, 0.75, "query heads dealt 2 + 1; both ranks hold KV", size=9.5)
    text(ax, 5.3, 0.5, "head 0, whose gradients one all-reduce sums", size=9.5)
    text(ax, 3.5, 0.14, "Per head no communication; the row-parallel output projection ends "
         "in one all-reduce (g).", size=10)
    legend(ax, 5.0, 3.42)
    save(fig, "attention.png")


def sequence_parallel():
    """(e) Sequence shards between the blocks: all-gather in, reduce-scatter out."""
    fig, ax = canvas(7, 4.2)
    text(ax, 3.5, 4.0, "Sequence parallelism: sequence shards outside the TP region", size=12,
         weight="bold")
    regions = ((0.1, 1.95, "sequence shards", "T/2 tokens per rank"),
               (2.55, 4.45, "tensor parallel", "all T tokens, features split"),
               (5.05, 6.9, "sequence shards", "T/2 tokens per rank"))
    for x0, x1, name, sub in regions:
        ax.add_patch(Rectangle((x0, 1.0), x1 - x0, 2.75, facecolor="#F2F2F2", edgecolor="none"))
        text(ax, (x0 + x1) / 2, 3.58, name, size=10.5, color="#444444", style="italic")
        text(ax, (x0 + x1) / 2, 3.36, sub, size=9, color="#666666")
    t, cell = 4, 0.2

    def tokens(x, y, r, full):
        """A bar of t tokens: the ones rank r holds filled in its colour."""
        for k in range(t):
            held = full or k // (t // 2) == r
            ax.add_patch(Rectangle((x + k * cell, y), cell, cell,
                                   facecolor=RANK[r] if held else "white",
                                   edgecolor=INK if held else "#AAAAAA", lw=0.8,
                                   ls="-" if held else "--"))

    for r, y in enumerate((2.3, 1.2)):
        box(ax, 0.25, y + 0.3, 1.6, 0.55, "RMSNorm, dropout", LIGHT[r], size=10)
        text(ax, 0.22, y + 0.07, f"rank {r}", size=9.5, color=RANK[r], ha="left",
             weight="bold")
        tokens(0.95, y - 0.03, r, False)
        arrow(ax, 1.85, y + 0.57, 2.0, y + 0.57)
        box(ax, 2.65, y + 0.3, 1.7, 0.55, "column → act → row", RANK[r], color="white",
            size=9.5)
        tokens(3.1, y - 0.03, r, True)
        arrow(ax, 2.5, y + 0.57, 2.65, y + 0.57)
        arrow(ax, 4.35, y + 0.57, 4.5, y + 0.57)
        box(ax, 5.2, y + 0.3, 1.55, 0.55, "dropout, + residual", LIGHT[r], size=10)
        tokens(5.58, y - 0.03, r, False)
        arrow(ax, 5.0, y + 0.57, 5.2, y + 0.57)
    for x, what in ((2.0, "all-gather"), (4.5, "reduce-scatter")):
        box(ax, x, 1.1, 0.5, 2.1, "", "#EADCF3", edge=COMM)
        text(ax, x + 0.25, 2.15, what, size=11, color=COMM, rotation=90, weight="bold")
    text(ax, 0.1, 0.72, "gather_from_sequence: all-gather forward, reduce-scatter backward "
         "(where f was)", ha="left", color=COMM, size=10)
    text(ax, 0.1, 0.44, "reduce_scatter_to_sequence: reduce-scatter forward, all-gather "
         "backward (where g was)", ha="left", color=COMM, size=10)
    text(ax, 0.1, 0.14, "Same bytes as the all-reduce; outside the TP region each rank keeps "
         "1/TP of the tokens.", ha="left", size=10)
    save(fig, "sequence_parallel.png")


def vocab_loss():
    """The vocab-parallel loss: two numbers a token cross the ranks, never the logits."""
    fig, ax = canvas(7, 3.4)
    text(ax, 3.5, 3.2, "Vocab-parallel cross-entropy: the logits stay split", size=12,
         weight="bold")
    for r, y in enumerate((2.15, 0.95)):
        box(ax, 0.2, y, 1.75, 0.7, f"logits z$_{r}$\n(B, T, V/2): ids\n{r * 500}-{r * 500 + 499}",
            RANK[r], color="white", size=9.5)
        arrow(ax, 1.95, y + 0.35, 2.25, y + 0.35)
        box(ax, 2.25, y, 1.85, 0.7, f"logsumexp of z$_{r}$\nz[target] if rank {r}\nholds it",
            LIGHT[r], size=9.5)
        arrow(ax, 4.1, y + 0.35, 4.45, y + 0.35)
    box(ax, 4.45, 0.95, 0.55, 1.9, "", "#EADCF3", edge=COMM)
    text(ax, 4.72, 1.9, "all-gather", size=11, color=COMM, rotation=90, weight="bold")
    arrow(ax, 5.0, 1.9, 5.25, 1.9)
    box(ax, 5.25, 1.4, 1.6, 1.0, "loss =\nlogsumexp(l$_0$, l$_1$)\n- z[target]", GREY, size=9.5)
    text(ax, 0.2, 0.55, "Forward sends 2 numbers per token and rank; the (B, T, V) logits are "
         "never gathered.", ha="left", size=10)
    text(ax, 0.2, 0.25, "Backward (softmax - onehot on each slice) needs only the global "
         "logsumexp: nothing sent.", ha="left", size=10)
    save(fig, "vocab_loss.png")


# Llama-2-7B, bf16, batch 1 x 2048, 80 GB (learn.md's plan): weights, AdamW + master, peak
MEMORY = {1: (13.48, 80.86, 109.21), 2: (6.74, 40.43, 57.24), 4: (3.37, 20.22, 31.37),
          8: (1.69, 10.11, 18.44)}


def memory():
    """A step's peak per rank, by what holds it, against the device."""
    fig = plt.figure(figsize=(7, 3.6))
    ax = fig.add_axes((0.09, 0.1, 0.56, 0.78))
    xs = range(len(MEMORY))
    parts = [("bf16 weights", [w for w, _, _ in MEMORY.values()], RANK[0]),
             ("AdamW moments\n+ fp32 master weights", [o for _, o, _ in MEMORY.values()],
              RANK[1]),
             ("the step's largest\nmoment: gradients,\nactivations, temporaries",
              [p - w - o for w, o, p in MEMORY.values()], COMM)]
    bottom = [0.0] * len(MEMORY)
    for label, values, color in parts:
        ax.bar(xs, values, 0.6, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (_, _, peak) in zip(xs, MEMORY.values(), strict=True):
        ax.text(x, peak + 2, f"{peak:.1f}", ha="center", fontsize=9.5)
    ax.axhline(80, color=INK, lw=1)
    ax.axhline(72, color=INK, lw=1, ls="--")
    ax.text(3.45, 81, "80 GB device", fontsize=9, ha="right", va="bottom")
    ax.text(3.45, 71, "72 GB usable", fontsize=9, ha="right", va="top")
    ax.set_xticks(list(xs), [f"TP={tp}" for tp in MEMORY])
    ax.set_ylabel("GB per rank")
    ax.set_ylim(0, 120)
    ax.set_title("Llama-2-7B, bf16 training, 1 x 2,048 tokens: peak per rank", fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, frameon=False,
              labelspacing=1.0)
    save(fig, "memory.png")


def layout():
    """16 ranks as ("pp", "dp", "tp") = (2, 2, 4): a stage per machine, TP innermost."""
    fig, ax = canvas(7, 3.4)
    text(ax, 3.5, 3.2, "16 ranks, PP=2 x DP=2 x TP=4: rank = 8 pp + 4 dp + tp", size=12,
         weight="bold")
    for pp in range(2):
        x0 = 0.2 + pp * 3.5
        box(ax, x0, 0.55, 3.1, 2.3, "", "white", edge="#999999")
        text(ax, x0 + 1.55, 2.65, f"machine {pp}: pipeline stage {pp}", size=10)
        for dp in range(2):
            y = 1.75 - dp * 0.95
            box(ax, x0 + 0.1, y - 0.05, 2.9, 0.7, "", LIGHT[dp], edge=RANK[dp])
            text(ax, x0 + 0.15, y + 0.55, f"TP group (dp {dp})", size=8.5, ha="left",
                 color=RANK[dp])
            for tp in range(4):
                rank = 8 * pp + 4 * dp + tp
                box(ax, x0 + 0.2 + tp * 0.7, y, 0.6, 0.45, f"{rank}", RANK[dp], color="white",
                    size=10, weight="bold")
    arrow(ax, 3.3, 1.7, 3.7, 1.7, color=COMM, lw=2)
    text(ax, 3.5, 1.95, "PP", size=10, color=COMM, weight="bold")
    text(ax, 0.2, 0.3, "TP: ranks 4k..4k+3 (fast links, every block); DP: rank r with r + 4 "
         "(gradients, once a step);", ha="left", size=9.5)
    text(ax, 0.2, 0.08, "PP: rank r with r + 8 (one activation per micro-batch, across "
         "machines).", ha="left", size=9.5)
    save(fig, "layout.png")


def one_f_one_b(p, m):
    """Start times of each stage's forwards and backwards under 1F1B (forward 1, backward 2)."""
    order = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        order.append(ops + [("B", i) for i in range(m - warm, m)])
    done, clock, pos = {}, [0] * p, [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(order[s]):
                kind, i = order[s][pos[s]]
                need = ([("F", s - 1, i)] if kind == "F" and s else
                        [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else []))
                if kind == "F" and not s:
                    need = []
                if any(n not in done for n in need):
                    break
                start = max([clock[s]] + [done[n] for n in need])
                done[(kind, s, i)] = start + (1 if kind == "F" else 2)
                clock[s] = done[(kind, s, i)]
                pos[s] += 1
    return done


def bubble():
    """1F1B on 4 stages and 8 micro-batches: where each stage idles."""
    p, m = 4, 8
    done = one_f_one_b(p, m)
    end = max(done.values())
    fig, ax = canvas(7, 2.9)
    unit = 6.2 / end
    text(ax, 3.5, 2.7, f"1F1B, {p} stages, {m} micro-batches: the bubble is grey", size=12,
         weight="bold")
    for s in range(p):
        y = 2.1 - s * 0.42
        text(ax, 0.35, y + 0.17, f"stage {s}", size=9.5)
        ax.add_patch(Rectangle((0.7, y), end * unit, 0.34, facecolor=GREY, edgecolor="none"))
        for (kind, stage, i), t in done.items():
            if stage == s:
                w = 1 if kind == "F" else 2
                box(ax, 0.7 + (t - w) * unit, y, w * unit, 0.34, f"{i}",
                    LIGHT[0] if kind == "F" else RANK[1], size=8)
    text(ax, 0.35, 0.3, "light: a micro-batch's forward; orange: its backward (twice as long)",
         ha="left", size=9.5)
    text(ax, 0.35, 0.08, f"each stage idles {p - 1} forwards and {p - 1} backwards in all: "
         f"({p} - 1) / {m} of its work", ha="left", size=9.5)
    save(fig, "bubble.png")


# 8 tokens, 4 on each EP rank, each choosing 2 of 4 experts (E0, E1 on rank 0; E2, E3 on rank 1)
MOE_CHOICES = [(0, 2), (1, 3), (0, 1), (2, 3), (1, 2), (0, 3), (2, 3), (0, 1)]


def moe_dispatch():
    """EP=2: route, sort the (token, expert) rows by expert, all-to-all there, experts, back."""
    fig, ax = canvas(7, 4.45)
    text(ax, 3.5, 4.27, "Expert parallelism on 2 ranks: 4 experts, top-2, 4 tokens a rank",
         size=12, weight="bold")
    cell, xs = 0.27, (0.25, 1.35, 4.45, 5.95)
    for x, head in zip(xs, ("tokens", "rows sorted\nby expert", "experts", "y: weighted\nsum"),
                       strict=True):
        text(ax, x + 0.45, 3.87, head, size=9.5)
    for r in range(2):
        top = 3.55 - r * 1.85
        box(ax, 0.1, top - 1.68, 6.8, 1.78, "", "none", edge=RANK[r])
        text(ax, 0.17, top - 1.58, f"rank {r}", size=9, ha="left", color=RANK[r])
        toks = range(4 * r, 4 * r + 4)
        for i, t in enumerate(toks):  # the tokens, and each one's output after the combine
            box(ax, xs[0] + 0.1, top - (i + 1) * cell - 0.04, 0.7, cell - 0.05, f"t{t}", GREY,
                size=8.5)
            box(ax, xs[3] + 0.1, top - (i + 1) * cell - 0.04, 0.7, cell - 0.05, f"y{t}", GREY,
                size=8.5)
        rows = sorted((e, t) for t in toks for e in MOE_CHOICES[t])
        for i, (e, t) in enumerate(rows):  # 8 rows, coloured by the rank holding their expert
            y = top - (i + 1) * cell / 1.45
            box(ax, xs[1], y, 0.95, cell / 1.45 - 0.03, f"E{e}  t{t}", RANK[e // 2],
                color="white", size=7.5)
            if e // 2 != r:  # it travels: to the other rank's experts
                ax.add_patch(FancyArrowPatch((xs[1] + 0.97, y + 0.08),
                                             (xs[2] - 0.05, 3.55 - (e // 2) * 1.85 - 0.75),
                                             arrowstyle="-|>", mutation_scale=8, color=COMM,
                                             lw=0.8, alpha=0.7))
        text(ax, xs[0] + 0.45, top - 4 * cell - 0.25, "router: top-2", size=8.5)
        for j in range(2):
            e = 2 * r + j
            n = sum(e in c for c in MOE_CHOICES)
            box(ax, xs[2] + j * 0.72, top - 1.15, 0.62, 0.8, f"E{e}\n{n} rows", RANK[r],
                color="white", size=8.5, weight="bold")
        arrow(ax, xs[2] + 1.42, top - 0.75, xs[3] + 0.05, top - 0.75, color=COMM)
    text(ax, 3.3, 3.1, "all-to-all:\nsizes, then rows", size=9, color=COMM)
    text(ax, 5.55, 2.1, "all-to-all back, × weights", size=8.5, color=COMM)
    save(fig, "moe_dispatch.png")


def context_parallel():
    """CP=2, 16 tokens in 4 chunks: each rank's causal work on the gathered keys; what it holds."""
    fig, ax = canvas(7, 4.6)
    text(ax, 3.5, 4.42, "CP, 2 ranks: rank r holds chunks r and 3 - r of 4", size=12, weight="bold")
    t, cell, x0, top = 16, 0.13, 0.75, 3.75
    rank_of = [min(k // 4, 3 - k // 4) for k in range(t)]
    grid(ax, x0, top, t, t, cell, lambda i, j: RANK[rank_of[i]] if j <= i else "white")
    text(ax, x0 + t * cell / 2, top + 0.17, "keys 0 .. 15 (K, V gathered)", size=9.5)
    text(ax, 0.2, top - t * cell / 2, "queries 0 .. 15", size=9.5, rotation=90)
    for c in range(4):  # the chunks beside their query rows
        box(ax, 0.42, top - (c + 1) * 4 * cell + 0.02, 0.28, 4 * cell - 0.04, f"c{c}",
            RANK[rank_of[4 * c]], color="white", size=8.5, weight="bold")
    for r in range(2):  # the (query, key) pairs of each of its chunks
        parts = [sum(range(4 * c + 1, 4 * c + 5)) for c in (r, 3 - r)]
        text(ax, 0.2, 1.28 - r * 0.27, f"rank {r}: {parts[0]} + {parts[1]} = {sum(parts)} "
             "(query, key) pairs", size=9.5, color=RANK[r], ha="left", weight="bold")
    text(ax, 3.3, 3.95, "what a rank holds", ha="left", style="italic", color="#444444")
    for r, k in ((r, k) for r in range(2) for k in range(2)):  # k 1: the gathered K, V
        y = 3.17 - r * 1.2 - k * 0.33
        text(ax, 3.3, 3.55 - r * 1.2, f"rank {r}", color=RANK[r], ha="left", weight="bold")
        text(ax, 3.3, y + 0.06, ("its T/N tokens", "K, V: all T")[k], size=9, ha="left")
        for i in range(t):  # its own tokens in its colour, the gathered ones light
            own = rank_of[i] == r
            ax.add_patch(Rectangle((4.55 + i * cell, y), cell, cell, lw=0.6,
                                   facecolor=RANK[r] if own else
                                   (LIGHT[rank_of[i]] if k else "white"),
                                   edgecolor=INK if own or k else "#AAAAAA",
                                   ls="-" if own or k else "--"))
    text(ax, 3.3, 1.28, "activations, norms, MLP, loss: T/N tokens a rank", size=9, ha="left")
    text(ax, 3.3, 1.01, "K, V: all-gather forward, reduce-scatter backward", size=9,
         ha="left", color=COMM)
    text(ax, 0.2, 0.47, "Sequence parallelism splits norms and dropout, but every rank's "
         "attention still reads all T queries\n(T x T scores a head). CP splits the queries: "
         "(T/N) x T a rank, and the causal work is even.", size=9.5, ha="left", linespacing=1.8)
    save(fig, "context_parallel.png")


if __name__ == "__main__":
    column_split()
    row_split()
    mlp()
    attention()
    sequence_parallel()
    vocab_loss()
    memory()
    layout()
    bubble()
    moe_dispatch()
    context_parallel()
