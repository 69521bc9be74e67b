"""``model(input_ids, labels=labels).loss`` on a converted model, computed on the logits split
by vocabulary: the head gathers nothing when a loss is asked for.

transformers' causal LMs compute ``self.loss_function(logits=..., labels=..., vocab_size=...)``
in their forward. After conversion a head planned ``column_gather`` gathers its logits only when
the call has no ``labels`` (``generate``, scoring, a caller that wants them whole), and the
model's ``loss_function`` is transformers' ``ForCausalLMLoss`` rewritten over
``vocab_parallel_cross_entropy``: labels shifted by one (or ``shift_labels`` as given), ``-100``
ignored, the sum over the targets divided by their count, or by ``num_items_in_batch`` (as
transformers' Trainer passes it under gradient accumulation). With labels, ``out.logits`` is this
rank's slice of the vocabulary, (B, T, V_local); ``model.gather_logits = True`` makes the head
gather them always (the loss is the same either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy


def vocab_parallel_labels_loss(model: nn.Module, head: nn.Module,
                               group: ProcessGroup | None) -> None:
    """Make ``model``'s ``labels=`` loss vocab-parallel, its ``head`` (a gathering column layer)
    gather only for calls without labels."""

    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      num_items_in_batch: torch.Tensor | int | None = None,
                      ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                      **_) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        if logits.shape[-1] == vocab_size:  # gathered (gather_logits): one rank's plain loss
            total = F.cross_entropy(logits.float().flatten(0, -2), shift_labels.flatten(),
                                    ignore_index=ignore_index, reduction="sum")
        else:
            total = vocab_parallel_cross_entropy(logits.float(), shift_labels, group=group,
                                                 ignore_index=ignore_index, reduction="sum",
                                                 vocab_size=vocab_size)
        count = num_items_in_batch if num_items_in_batch is not None else \
            (shift_labels != ignore_index).sum()
        if torch.is_tensor(count):
            count = count.to(total.device)
        return total / count

    def before_forward(module, args, kwargs):
        head.gather_output = kwargs.get("labels") is None or getattr(module, "gather_logits",
                                                                      False)

    model.loss_function = loss_function
    model.gather_logits = False
    model.register_forward_pre_hook(before_forward, with_kwargs=True)
