"""Training as torch alone does it, the outside reference of the trainers' tests: AdamW
(``torch.optim.AdamW``, no weight decay on vectors), ``LambdaLR`` with the documented schedule
written here from its definition, and ``torch.nn.utils.clip_grad_norm_``."""

import math

import torch


def schedule(step: int, cfg) -> float:
    """The documented schedule as a factor of lr: linear warmup, cosine to a tenth."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))


def torch_loop(cfg, model: torch.nn.Module, batches, loss_of):
    """Train ``model`` for cfg.steps with torch's AdamW (no decay on vectors), LambdaLR and
    clip_grad_norm_; its (lr, loss, grad norm) each step."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, cfg))
    rows = []
    for step in range(cfg.steps):
        x, y = batches.batch(step)[:2]
        loss = loss_of(model, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(decay + rest, cfg.grad_clip)
        rows.append((sched.get_last_lr()[0], loss.item(), norm.item()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return rows


def compare_rows(rows, want, tol, what=""):
    """The trainer's metrics rows against ``torch_loop``'s; the worst relative error."""
    assert len(rows) == len(want) > 0
    worst = 0.0
    for row, (lr, loss, norm) in zip(rows, want, strict=True):
        assert math.isclose(row["lr"], lr, rel_tol=1e-12), (what, row, lr)
        for key, value in (("loss", loss), ("grad_norm", norm)):
            err = abs(row[key] - value) / abs(value)
            worst = max(worst, err)
            assert err <= tol, f"{what} step {row['step']} {key}: {row[key]} vs {value} ({err:.1e})"
    return worst
