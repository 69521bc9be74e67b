"""``tensorpar bench`` as a user meets it, run as ``python -m tensorpar``: a contender of another
library that cannot run the configuration is a table row "skipped: <why>" while tensorpar's row
is measured (exit 0, no traceback); an earlier run's files in --out are replaced or removed,
other files left alone; the profiler prints nothing of its own; a bad --out is one line before
any rank starts."""

import importlib.util
import json
import os

import pytest

from tests_common import tensorpar_cli as tensorpar
from tests_common import tensorpar_here

# tensorpar splits 8 query heads over 3 ranks (3, 3, 2) and shares the 2 KV heads; DTensor and
# megatron-core split only evenly
TINY = ["--dim", "64", "--n-head", "8", "--n-kv-head", "2", "--n-layer", "1", "--vocab-size",
        "96", "--seq-len", "12", "--batch-size", "2", "--repeats", "1", "--steps-per-repeat", "1"]


def _rows(stdout: str) -> dict[str, list[str]]:
    """The table's cells by contender."""
    return {cells[0]: cells[1:] for line in stdout.splitlines() if line.startswith("| ")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[0] != "contender"}


def test_contender_that_cannot_run_is_skipped(tmp_path):
    """8 heads over 3 ranks: DTensor refuses them on its ranks (a ValueError on each, before any
    collective), megatron-core before its ranks are spawned (or is not installed); each row
    says why in one line, tensorpar's row is measured and checked against the dense reference,
    exit 0, no traceback. --out held an earlier --profile run's files and a file of
    the user's: the table, JSON and chart are rewritten, the stale profile.md removed and
    named, the user's file kept."""
    out_dir = tmp_path / "bench"
    out_dir.mkdir()
    for name in ("bench.md", "profile.md", "notes.txt"):
        (out_dir / name).write_text("from before\n")
    out = tensorpar("bench", *TINY, "--tp", "3", "--contenders", "tensorpar,dtensor,megatron",
                    "--out", "bench", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    rows = _rows(out.stdout)
    dtensor = ("skipped: dtensor: --n-head 8 and --n-kv-head 2 do not divide by --tp 3 (its "
               "column-parallel q/k/v need whole heads on each rank)")
    megatron = ("skipped: megatron-core splits evenly, without padding: --n-head 8 does not "
                "divide by --tp 3" if importlib.util.find_spec("megatron") else
                "skipped: not installed (megatron-core)")
    assert rows["dtensor"][:2] == ["3x1", dtensor] and rows["megatron"][:2] == ["3x1", megatron]
    assert rows["tensorpar"][0] == "3x1" and float(rows["tensorpar"][1]) > 0, rows
    # the loss against the dense fp32 model: measured 2.1e-7 (2026-11-27, torch 2.13 CPU)
    assert float(rows["tensorpar"][-1]) <= 2e-6
    assert f"dtensor {dtensor}\n" in out.stderr and f"megatron {megatron}\n" in out.stderr
    assert out.stdout.rstrip().splitlines()[-2:] == [
        "wrote bench/bench.md, bench/bench.json, bench/bench.png",
        "removed an earlier run's bench/profile.md"]
    assert sorted(os.listdir(out_dir)) == ["bench.json", "bench.md", "bench.png", "notes.txt"]
    assert (out_dir / "notes.txt").read_text() == "from before\n"
    data = json.loads((out_dir / "bench.json").read_text())
    assert [r["status"] for r in data["contenders"]] == ["ok", dtensor, megatron]
    assert data["errors"] == [] and sorted(os.listdir(tmp_path)) == ["bench"]


def test_profile_is_quiet_and_written(tmp_path):
    """--profile writes profile.md, named in the ``wrote`` line; the profiler's own C++ logging
    ("USDT: ... profiler_start") stays off the terminal."""
    out = tensorpar("bench", *TINY, "--tp", "1", "--contenders", "tensorpar-tp1", "--profile",
                    "--profile-steps", "1", "--out", tmp_path, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USDT" not in out.stderr + out.stdout and "profiler_st" not in out.stderr, out.stderr
    assert out.stdout.rstrip().splitlines()[-1] == "wrote " + ", ".join(
        str(tmp_path / f) for f in ("bench.md", "bench.json", "bench.png", "profile.md"))
    assert "Profile of `tensorpar-tp1`" in (tmp_path / "profile.md").read_text()


@pytest.mark.parametrize("flags,message", [
    (["--out", "taken"], "--out taken is a file; name a directory for the results"),
    (["--out", "taken/bench"], "--out taken/bench: cannot create it"),
    (["--tp", "3", "--n-head", "8", "--dim", "60"], "--dim 60 must divide by --n-head 8"),
])
def test_bad_flags_are_one_line(tmp_path, flags, message):
    """Refused before any rank starts: one line, exit 2, nothing written."""
    (tmp_path / "taken").write_text("a file\n")
    out = tensorpar_here("bench", *flags, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.startswith(f"tensorpar bench: {message}"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_failures_are_told_apart():
    """A ValueError on every rank is a refusal (skipped, with its message); anything else from
    another library is a failed row with its tracebacks kept for bench.json; any failure of
    tensorpar's own contenders or the reference is an error of the run (exit 1), printed whole."""
    from tensorpar.bench.runner import _fail, failure_reason
    from tensorpar.ranks.local import RankError

    def ranks_raising(*last_lines, why=""):
        return RankError("\n".join([why] * bool(why) + [
            f"--- rank {r} failed:\nTraceback (most recent call last):\n  File \"x.py\"\n{ln}"
            for r, ln in enumerate(last_lines)]))

    refusal = ranks_raising("ValueError: 8 heads over 3", "ValueError: 8 heads over 3")
    crash = ranks_raising("ValueError: 8 heads over 3", "RuntimeError: gloo hung up")
    hung = ranks_raising("ValueError: 8 heads over 3", why="ranks [1] did not finish")
    assert failure_reason(refusal) == ("8 heads over 3", True)
    assert failure_reason(crash) == ("RuntimeError: gloo hung up", False)
    assert failure_reason(hung) == ("ranks [1] did not finish; ValueError: 8 heads over 3", False)
    rows, errors, said = {n: {"name": n} for n in ("dtensor", "megatron", "tensorpar")}, [], []
    _fail(rows, errors, said.append, "dtensor", refusal)
    _fail(rows, errors, said.append, "megatron", crash)
    _fail(rows, errors, said.append, "tensorpar", refusal)
    assert rows["dtensor"] == {"name": "dtensor", "status": "skipped: 8 heads over 3"}
    assert rows["megatron"]["status"] == "failed: RuntimeError: gloo hung up"
    assert "Traceback" in rows["megatron"]["error"] and len(said[1].splitlines()) == 1
    assert rows["tensorpar"]["status"] == "failed: 8 heads over 3"
    assert [e["name"] for e in errors] == ["tensorpar"] and "Traceback" in said[2]
