"""What ranks run on: process groups (``groups``), the local launcher and torchrun mode
(``launch``), what went wrong on a rank (``failures``), the check mode that compares collectives
across ranks (``checking``), collective accounting (``counting``), atomic output files
(``output``), and the seeds of every random stream (``seeds``).

The bottom of the core: imports torch only, nothing else from tensorpar.
"""
