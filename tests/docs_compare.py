"""What a docs page shows a program print, against what the program prints now.

A page shows a program's output in the ```text block right after the program (one blank line
between). ``differences(shown, printed)`` compares the two line by line: the words between the
numbers must be equal (runs of spaces count as one), and each number must equal the printed one
to a unit of its last shown digit (integers exactly); a number in e-notation below
``ROUNDING`` is a rounding error (the difference of a parallel result from the dense one), and
may differ by a factor of ``ROUNDING_FACTOR`` either way (the order of a matmul's sums changes
with the build of torch), or both be at most one fp32 ulp of 1 (0, 5.96e-08 and 1.19e-07 are
one rounding apart).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")
ROUNDING = 1e-5
ROUNDING_FACTOR = 2.0
ULP = 1.2e-7  # fp32's spacing just above 1 is 1.19e-07


def _parts(line: str) -> tuple[list[str], list[str]]:
    """(the words between the numbers, spaces collapsed; the numbers as written)."""
    numbers = NUMBER.findall(line)
    words = [" ".join(w.split()) for w in NUMBER.split(line)]
    return words, numbers


def _value(text: str) -> float:
    return float(text.replace(",", "").lstrip("+"))


def _close(shown: str, printed: str) -> bool:
    a, b = _value(shown), _value(printed)
    if "e" in shown and abs(a) < ROUNDING:
        if abs(b) >= ROUNDING:
            return False
        small, large = sorted((abs(a), abs(b)))
        return large <= ULP or large <= ROUNDING_FACTOR * small
    decimals = len(shown.split("e")[0].partition(".")[2])
    scale = 10.0 ** int(shown.split("e")[1]) if "e" in shown else 1.0
    return abs(a - b) <= (1.01 * 10.0 ** -decimals * scale if decimals else 0.0)


def differences(shown: str, printed: str) -> list[str]:
    """The lines where ``printed`` differs from ``shown`` beyond the tolerances above, each as
    'line N: shown ... / printed ...'; empty when they agree."""
    a, b = shown.rstrip().splitlines(), printed.rstrip().splitlines()
    if len(a) != len(b):
        return [f"{len(a)} lines shown, {len(b)} printed:\n{printed}"]
    found = []
    for no, (s, p) in enumerate(zip(a, b, strict=True), 1):
        (sw, sn), (pw, pn) = _parts(s), _parts(p)
        if sw != pw or len(sn) != len(pn) or not all(map(_close, sn, pn)):
            found.append(f"line {no}: shown   {s.strip()}\n         printed {p.strip()}")
    return found
