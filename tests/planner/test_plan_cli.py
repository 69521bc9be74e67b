"""``tensorpar plan`` as a user meets it (``cli.main`` in this process; the README's plan lines
run it as ``python -m tensorpar``): each mistake is one line on stderr and exit status 2, with no
traceback and nothing written; a size needs its unit; the default model is announced; every
file written is named in a ``wrote`` line. And the help of ``plan`` and ``bench``: plain text,
every flag explained with its default."""

import argparse
import json
import re

import pytest

from tensorpar.cli import bench as bench_cli
from tensorpar.cli import plan as plan_cli

from tests_common import leftovers, tensorpar_here


@pytest.mark.parametrize("flags,message", [
    (["--device-memory", "80"], "--device-memory '80': give the unit, e.g. 80GB or 80GiB"),
    (["--batch", "0"], "--batch 0 must be >= 1"),
    (["--png", "."], "--png . is a directory"),
    (["--png", "missing/plan.png"], "--png missing/plan.png: directory missing does not exist"),
    (["--dp", "0"], "--dp 0 must be >= 1"),
    (["--dp-mode", "zero"], "--dp-mode 'zero': expected fsdp or ddp"),
    (["--dp", "3", "--batch", "4"], "--batch 4 does not split over --dp 3"),
])
def test_one_line_for_each_mistake(tmp_path, flags, message):
    """A size without its unit (80: bytes or GB?) is refused, asking for the unit; a --png that
    names a directory or lies in a missing one is refused before anything is computed; a wrong
    value names its own flag only. One line, exit 2, no traceback, nothing on stdout, no file."""
    out = tensorpar_here("plan", "--model", "gpt2", "--tp", "2", *flags, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("tensorpar plan: ") and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr and out.stdout == ""
    if flags[0] == "--batch":
        assert "--seq" not in out.stderr  # only the flag that is wrong
    assert list(tmp_path.iterdir()) == []


def test_default_model_is_announced_and_files_named(tmp_path):
    """Without --model or --config the plan is llama-2-7b's, said on stderr; the chart is
    written atomically (no temporary file left) and named in a ``wrote`` line; with --json the
    notes go to stderr and stdout stays one JSON document."""
    out = tensorpar_here("plan", "--tp", "1,2", "--png", "plan.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ("tensorpar plan: planning llama-2-7b (the default; --model NAME or "
                          "--config FILE for another)\n")
    assert "llama-2-7b (6.74B params)" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1] == "wrote plan.png"
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert leftovers(tmp_path) == []
    out = tensorpar_here("plan", "--model", "gpt2", "--tp", "2", "--json", "--png",
                         tmp_path / "g.png", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.lstrip().startswith("{"), out.stderr
    assert out.stdout.rstrip().endswith("}") and out.stderr == f"wrote {tmp_path / 'g.png'}\n"


def _plan(*argv) -> int:
    ap = argparse.ArgumentParser()
    plan_cli.add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", *argv])
    return args.func(args)


def test_data_parallel_rows_and_communication(capsys):
    """--dp D --dp-mode M: each row is planned for D copies (one sequence each by default), the
    table says how the batch splits and adds the dp group's collectives; --json carries them
    per dtype and TP size; FSDP2 shards what DDP replicates."""
    assert _plan("--model", "gpt2", "--tp", "1,2", "--dp", "2", "--dp-mode", "ddp") == 0
    out = capsys.readouterr().out
    assert "batch 2 x DP=2 (ddp, 1 per copy)" in out and "TP=1 x DP=2 (ddp)" in out
    assert "data-parallel communication per step and rank (DP=2, ddp" in out
    rows = {}
    for mode in ("fsdp", "ddp"):
        assert _plan("--model", "gpt2", "--tp", "2", "--dp", "4", "--dp-mode", mode,
                     "--dtype", "fp32", "--json") == 0
        data = json.loads(capsys.readouterr().out)
        rows[mode] = data["rows"][0]
        assert (rows[mode]["dp"], rows[mode]["dp_mode"], rows[mode]["batch"]) == (4, mode, 4)
        assert set(data["dp_comm"]["fp32"]["2"]["counts"]) == (
            {"all_gather", "reduce_scatter", "all_reduce"} if mode == "fsdp" else {"all_reduce"})
    assert rows["fsdp"]["optimizer"] < rows["ddp"]["optimizer"] / 3


def test_sizes_need_a_unit():
    """80GB and 80GiB are different sizes, and 80 alone is neither: refused, asking for the
    unit; a plain byte count is written with B."""
    assert plan_cli.parse_bytes("80GB") == 80e9 and plan_cli.parse_bytes("24GiB") == 24 * 2**30
    assert plan_cli.parse_bytes("1.5e9B") == 1.5e9 and plan_cli.parse_bytes(" 512 mb") == 512e6
    for text, message in (("80", "give the unit, e.g. 80GB or 80GiB"),
                          ("8e10", "give the unit, e.g. 8e10B"), ("0GB", "must be above 0"),
                          ("80GX", "expected a size with a unit")):
        with pytest.raises(ValueError, match=re.escape(message)):
            plan_cli.parse_bytes(text)


RST = re.compile(r"``|::|:(class|func|meth|mod|attr|ref):`")


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0  # store_true / store_false / store_const: on or off, no value


@pytest.mark.parametrize("module", [plan_cli, bench_cli], ids=["plan", "bench"])
def test_help_is_plain_text_and_states_defaults(module):
    """Every flag of ``plan`` and ``bench`` has a help line; each one that takes a value states
    its default (or that it has none); the description and the rendered help hold no reST
    markup (``, ::, :class: roles), since argparse prints them as they are."""
    parser = module.add_parser(argparse.ArgumentParser(prog="tensorpar").add_subparsers())
    for text in (parser.description or "", parser.epilog or "", parser.format_help()):
        assert not RST.search(text), text
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = "/".join(action.option_strings)
        assert action.help and not RST.search(action.help), flag
        if not _is_switch(action):  # a flag without a default says so ("no default")
            assert "default" in action.help, f"{flag}: {action.help}"


def test_train_flags_plan_as_typed(capsys):
    """``tensorpar train``'s shape flags plan as typed: --batch-size, --seq-len and
    --micro-batch-size (sequences per pass and copy) give the plan of --batch, --seq and
    --micro-batches (the count: batch / (dp x size)), with a pipeline or with accumulation
    alone; both ways of giving the micro-batches at once are refused."""
    plans = []
    for argv in (["--batch-size", "16", "--seq-len", "512", "--micro-batch-size", "2"],
                 ["--batch", "16", "--seq", "512", "--micro-batches", "8"]):
        assert _plan("--model", "llama-2-7b", "--tp", "2", "--pp", "2", *argv, "--json") == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1]
    assert (plans[0]["batch"], plans[0]["seq"], plans[0]["micro_batches"],
            plans[0]["micro_batch"]) == (16, 512, 8, 2)
    plans = []
    for argv in (["--batch-size", "8", "--dp", "2", "--micro-batch-size", "2"],
                 ["--batch", "8", "--dp", "2", "--micro-batches", "2"]):
        assert _plan("--model", "gpt2", "--tp", "1", *argv, "--json") == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1] and plans[0]["micro_batch"] == 2
    assert _plan("--model", "gpt2", "--micro-batch-size", "2", "--micro-batches", "4") == 2
    assert "give one" in capsys.readouterr().err
    assert _plan("--model", "gpt2", "--batch-size", "8", "--micro-batch-size", "3") == 2
    err = capsys.readouterr().err
    assert err == ("tensorpar plan: --micro-batch-size 3 does not divide the 8 sequences of "
                   "each data-parallel copy (--batch-size / --dp)\n"), err


@pytest.mark.parametrize("content,message", [
    (b"\xf0\x9f\x00\xff" * 8, "is not a text file (binary data); expected a JSON file"),
    (b"n_layer = 4\n", "is not JSON (Expecting value at line 1, column 1); expected a GPTConfig"),
])
def test_config_that_is_not_json_is_one_line(tmp_path, capsys, content, message):
    """``--config`` on a binary file or on text that is not JSON: one line naming the file and
    what was expected, exit 2, no traceback."""
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    assert _plan("--config", str(path)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"tensorpar plan: --config {path} {message}"), captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
