"""The ground floor every layer stands on: process groups and their options (``groups``: size,
rank, device, timeout, whether collectives are checked), the seeds of every random stream
(``seeds``), collective accounting (``counting``), value checks that neither sync a GPU nor
break a graph (``asserts``), DTensors without importing them (``dtensors``), and atomic output
files and the one process that prints (``output``).

Imports torch only, nothing else from tensorpar; loads no launcher, signal handler, failure
report or check-mode module (``tests/test_layout.py`` checks a fresh ``import
tensorpar.parallel``).
"""
