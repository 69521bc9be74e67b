"""Checks on tensor values that neither stop the GPU nor break a ``torch.compile`` graph.

Reading a value (``int(ids.max())``) to check it costs nothing on the CPU, but on a GPU it makes
the host wait for every queued kernel, once per forward, and under ``torch.compile`` it ends the
graph (dynamo cannot trace a Python branch on a tensor's value). So a check runs where it is free:

- eager, tensor on the CPU: on the host, raising ``ValueError`` with the offending numbers
  (the same error on every rank, before any collective, since every rank holds the same ids);
- on a GPU, or inside a compiled graph: ``torch._assert_async``, a device-side assert queued
  with the kernels. The host never waits; a bad value fails the next synchronising call
  (on CUDA: "device-side assert triggered", with the message in the kernel's log; on the CPU
  under compile: a ``RuntimeError`` with the message).
"""

from __future__ import annotations

import torch


def is_compiling() -> bool:
    """True while dynamo traces the calling code (``torch.compile``)."""
    return torch.compiler.is_compiling()


def checks_on_host(t: torch.Tensor) -> bool:
    """Whether a check of ``t``'s values may read them on the host (free: eager, on the CPU)."""
    return t.device.type == "cpu" and not is_compiling()


def assert_in_range(t: torch.Tensor, stop: int, what: str, ignore: int | None = None) -> None:
    """A device-side assert that every value of integer ``t`` is in [0, stop) or equals
    ``ignore``; for where ``checks_on_host(t)`` is False (the callers check on the host, with
    the numbers in the message, where it is True).

    what: names the values in the error ("VocabParallelEmbedding: ids").
    """
    inside = (t >= 0) & (t < stop)
    if ignore is not None:
        inside |= t == ignore
    extra = "" if ignore is None else f" (or {ignore}, ignored)"
    torch._assert_async(inside.all(), f"{what}: a value is outside [0, {stop}){extra}")
