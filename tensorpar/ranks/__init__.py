"""Where ranks come from and how they end: local ranks forked from a server that imported torch
once (``forkserver``), the pool that runs functions on them and torchrun's ranks (``local``),
the one owner of signal handling (``signals``: Ctrl-C, preemption, forwarding), what went wrong
on a rank (``failures``), and the check mode's layer names (``checking``).

Imports the ground floor (``tensorpar.runtime``) and nothing above it; the layers never import
it.
"""
