"""``tensorpar verify`` end to end, as a user runs it: spawned ranks and torchrun's; and the
help of every subcommand. The commands go through their entry in this process
(``tensorpar_here``), their ranks forked from the session's fork server, under torchrun too
(``docs_torchrun.torchrun_here``: ranks with torchrun's environment): a new interpreter imports
torch for 3-5 s. ``python -m tensorpar`` as a process, and torchrun itself, are tested with
training (tests/train/test_stop_resume.py, test_torchrun_train.py)."""

import argparse

import pytest
from docs_torchrun import torchrun_here

from tests_common import cli_env, tensorpar_here


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--tp", "3", "--sequence-parallel"]])
def test_verify_passes(flags):
    """The table lists logits, loss and every gradient, all within 1e-5, and the collective
    counts match the scheme; exit code 0."""
    out = tensorpar_here("verify", *flags)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all outputs, gradients and collective counts match" in out.stdout
    for name in ("logits", "loss", "grad attn.k_proj.weight", "grad mlp.gate.weight",
                 "grad emb.weight", "all_reduce"):
        assert name in out.stdout
    assert "MISMATCH" not in out.stdout


def test_verify_under_torchrun(tmp_path):
    """The same command as one of torchrun's ranks (the ranks meet through torchrun's
    environment instead of our spawn): every rank judges, rank 0 alone prints the tables."""
    out = torchrun_here(2, ["-m", "tensorpar", "verify", "--tp", "2"], tmp_path, cli_env(),
                        timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("all outputs, gradients and collective counts match") == 1, out.stdout
    assert out.stdout.count("tensorpar verify: TP=2") == 1, out.stdout


@pytest.mark.parametrize("flags", [
    ["--pp", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "11"],
    ["--pp", "4", "--tp", "1"],
], ids=["pp2-tp2-sp", "pp4"])
def test_verify_pipeline_passes(flags):
    """``verify --pp``: one pipelined step equals the whole model on one rank (loss, every
    gradient, the norm), and each pipeline rank's sends, receives and TP collectives are the
    planner's count. 11 tokens over TP 2 under SP: the TP ranks send shards of 6 and 5 tokens.
    The default GPT ties its head to its embedding: the first and the last rank all-reduce the
    table's gradient once more than the middle ones. At pp 4 the middle ranks send twice what
    the ends send, under the check mode (verify's
    default), which numbers sends and collectives together on a group: the schedule's transfers
    have their own group, or the loss's all-reduce after them would be called a mismatch."""
    out = tensorpar_here("verify", *flags)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the loss, every gradient and every transfer match" in out.stdout
    for name in ("grad blocks.0.attn.q_proj.weight", "grad embed.weight", "gradient norm",
                 "pp send", "pp recv"):
        assert name in out.stdout
    if "--sequence-parallel" in flags:  # 2 micro-batch rows x 6 or 5 tokens x 64 x 4 bytes
        assert "12288/10240 / 12288/10240" in out.stdout.replace("10240/12288", "12288/10240")
    else:
        sends = next(line for line in out.stdout.splitlines() if line.startswith("pp send "))
        assert sends.split()[2:] == ["8", "/", "8", "16", "/", "16", "16", "/", "16", "8", "/",
                                     "8"], sends
        sums = next(line for line in out.stdout.splitlines()
                    if line.startswith("pp all_reduce "))
        assert sums.split()[2:] == ["3", "/", "3", "2", "/", "2", "2", "/", "2", "3", "/",
                                    "3"], sums
    assert "MISMATCH" not in out.stdout


def test_verify_pipeline_reports_a_mismatch():
    """A gradient off, or one send more than the count, fails the report."""
    from tensorpar.cli.verify_pipeline import PipelineCheck, expected_transfers, report_pipeline
    from tensorpar.transformer.reference import BlockConfig

    check = PipelineCheck(BlockConfig(), 3, 2, 1, 4, 1, False)

    def rank(p, err=1e-7, extra=0):
        pp = expected_transfers(check, p, 0)
        counts = dict(pp["counts"], send=pp["counts"]["send"] + extra)
        return {"errors": {"loss": 1e-7, "grad norm.weight": err}, "pp_rank": p, "tp_rank": 0,
                "shapes": {"loss": (), "grad norm.weight": (64,)},
                "counts": {"pp": {"counts": counts, "bytes": pp["bytes"]}, "tp": {}}}

    assert report_pipeline([rank(0), rank(1)], check, write=lambda *a: None)
    assert not report_pipeline([rank(0), rank(1, err=1e-3)], check, write=lambda *a: None)
    assert not report_pipeline([rank(0, extra=1), rank(1)], check, write=lambda *a: None)


@pytest.mark.parametrize("flags,message", [
    (["--tp", "4", "--num-heads", "2", "--num-kv-heads", "1", "--dim", "16"],
     "num_heads=2 cannot be split over 4 ranks"),
    (["--tp", "4", "--sequence-parallel", "--seq-len", "3"],
     "--seq-len 3 is shorter than --tp 4"),
    (["--micro-batches", "4"], "--micro-batches and --n-layer are for a pipeline: give --pp N"),
    (["--pp", "2", "--hf", "x"], "verify --hf with --pp: pipeline stages are built for"),
    (["--pp", "2", "--micro-batches", "1"], "--pp 2 needs at least 2 micro-batches"),
    (["--pp", "2", "--n-layer", "1"], "--n-layer 1 cannot be cut into 2 pipeline stages"),
])
def test_verify_bad_sizes(flags, message):
    """Impossible sizes: one clear line and exit code 2, no traceback, no ranks started."""
    out = tensorpar_here("verify", *flags)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_verify_reports_a_mismatch():
    """An error above tolerance or an unexpected collective makes report() fail (exit code 1)."""
    from tensorpar.cli.verify import expected_collectives, report
    from tensorpar.transformer.reference import BlockConfig

    cfg = BlockConfig()
    good = {"errors": {"loss": 1e-7}, "shapes": {"loss": ()},
            "counts": expected_collectives(cfg, 2, False)}
    assert report([good, good], cfg, 2, False)
    bad_error = {**good, "errors": {"loss": 1e-3}}
    assert not report([good, bad_error], cfg, 2, False)
    extra = {**good, "counts": {"forward": {"all_reduce": 5, "all_gather": 1},
                                "backward": {"all_reduce": 3}}}
    assert not report([extra, good], cfg, 2, False)


def _subparsers():
    from tensorpar.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["train", "generate", "export", "verify", "plan", "bench"])
def test_every_flag_has_plain_help_with_its_default(command):
    """Each flag of each subcommand says what it does and its default (or that it is required),
    in plain text: no reST markup, which argparse would print as is."""
    p = _subparsers()[command]
    texts = [p.description or "", p.epilog or ""]
    for action in p._actions:
        if action.dest == "help":
            continue
        flag = "/".join(action.option_strings)
        assert action.help, f"{command} {flag} has no help"
        text = action.help % {"default": action.default} if "%(" in action.help else action.help
        assert "default" in text or "required" in text, f"{command} {flag}: {text}"
        texts.append(text)
    for text in texts:
        for markup in ("``", "::", ":class:", ":func:", ":mod:"):
            assert markup not in text, f"{command}: {markup} in {text!r}"


def test_global_flags_before_or_after_the_command():
    """--debug, --timeout, --check-collectives, --device: the same flag, with its default in the
    help, before the command or after it (where a command has no flag of that name), the one
    given before the command kept when the command's parser runs."""
    from tensorpar.cli.main import COMMANDS, build_parser

    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(flags) == {"debug", "timeout", "check_collectives", "rank_device"}
    assert all("default" in a.help for a in flags.values())
    for command in COMMANDS:
        sub = parser._subparsers._group_actions[0].choices[command]
        own = sub._option_string_actions
        for dest, action in flags.items():
            flag = action.option_strings[0]
            if own[flag].dest == dest:  # the global flag, not the command's own of that name
                assert own[flag].help == action.help, (command, flag)
    after = parser.parse_args(["train", "--timeout", "20", "--debug", "--tp", "2"])
    before = parser.parse_args(["--timeout", "20", "--debug", "train", "--tp", "2"])
    assert (after.timeout, after.debug) == (before.timeout, before.debug) == (20.0, True)
    assert parser.parse_args(["--device", "cpu", "generate", "--ckpt", "r"]).rank_device == "cpu"
    assert parser.parse_args(["generate", "--ckpt", "r", "--device", "cpu"]).rank_device == "cpu"
    planned = parser.parse_args(["plan", "--model", "llama-2-7b", "--device", "cuda"])
    assert planned.device == "cuda" and planned.rank_device is None  # plan's own --device
