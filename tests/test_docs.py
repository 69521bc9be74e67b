"""The README's and the docs' examples run as written and print what the pages show.

Every ```python block (docs_source.py) is saved as NAME.py in an empty directory and run with
the command its first line gives (``python NAME.py`` in this process, as ``__main__``, its
ranks forked from the session's server, its RNGs and environment put back after:
``_python_here``; ``torchrun --standalone --nproc-per-node N NAME.py`` as N ranks forked from
that server with torchrun's environment: ``docs_torchrun.py``); what it prints is compared with the
```text block the page shows after it (docs_compare.py). Every line of a ```bash block either
runs here, in order, or is in ``NOT_RUN`` with the reason; a ``tensorpar`` line runs through
``cli.main`` in this process (``_run``), a ``torchrun --standalone`` line on forked ranks as
above, others as processes. A line that runs keeps its words;
only flags that make it small are added (``SMALL``), step counts are divided by
``STEP_SCALE`` (``--steps 800`` and ``step-00000800`` alike) and placeholder paths
(``PLACEHOLDERS``) are filled in. Examples write under ``runs/`` only, never into the
repository. The README's lines run in a directory of their own; the docs pages' in one directory
shared in the site's order (``mkdocs.yml``'s nav), so that a page finds what an earlier one
trained (the planner's page plans the run the training page wrote). The pages' static checks
(flags, the CLI reference, the site, the figures) are test_docs_pages.py's.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from docs_compare import differences
from docs_source import (
    DOCS,
    NOT_RUN,
    README,
    ROOT,
    bash_lines,
    env,
    page_name,
    python_blocks,
    shown_commands,
    tensorpar_at,
)
from docs_torchrun import torchrun_args, torchrun_here

from tensorpar.data.text import default_corpus

from tests_common import bpe_tokenizer, char_tokenizer, tensorpar_here

STEP_SCALE = 100  # --steps 400 -> 4; runs/gpt/step-00000800 -> step-00000008
DEFAULT_TRAIN_STEPS = 400  # a train line without --steps trains this many (tensorpar train)
# flags appended to each tensorpar subcommand (argparse: the last value wins)
SMALL_RUN = ["--seq-len", "32", "--batch-size", "2", "--warmup-steps", "1"]
SMALL = {
    "train": ["--n-layer", "1", "--dim", "32", "--n-head", "4", "--n-kv-head", "1", *SMALL_RUN],
    "generate": ["--max-new-tokens", "16"],
    "bench": ["--dim", "32", "--n-head", "4", "--n-kv-head", "2", "--n-layer", "1",
              "--vocab-size", "256", "--seq-len", "32", "--batch-size", "2", "--repeats", "1",
              "--steps-per-repeat", "1", "--profile-steps", "1",
              "--contenders", "tensorpar,dtensor"],  # the others: tests/bench
}
# words of the README that stand for a user's own file; filled in by the fixture of that name
PLACEHOLDERS = {"path/to/model": "hf_model", "path/to/tokenizer": "tokenizer_dir",
                "path/to/corpus/*.txt": "text_files",
                "path/to/instructions.jsonl": "instructions", "path/to/chat.jsonl": "chat",
                "path/to/held-out.txt": "held_out"}


def _small(sub: str, args: list[str]) -> list[str]:
    """A tensorpar subcommand's arguments made small: fewer steps, the SMALL flags added."""
    args = [re.sub(r"step-(\d{8})", lambda m: f"step-{int(m[1]) // STEP_SCALE:08d}", a)
            for a in args]
    if sub == "train":
        if "--steps" in args:
            i = args.index("--steps") + 1
            args[i] = str(max(1, int(args[i]) // STEP_SCALE))
        else:
            args += ["--steps", str(DEFAULT_TRAIN_STEPS // STEP_SCALE)]
        if "--resume" in args:  # the model and its settings come from the checkpoint
            return args
        if "--hf" in args:  # the model comes from its directory: the run alone made small
            return args + _not_given(SMALL_RUN, args)
        return args + _not_given(SMALL["train"], args)
    return args + SMALL.get(sub, [])


def _not_given(flags: list[str], args: list[str]) -> list[str]:
    """The (flag, value) pairs of ``flags`` whose flag ``args`` does not give (a train line that
    sets --n-layer or --batch-size keeps it: a pipeline needs its blocks and micro-batches)."""
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    return [w for flag, value in pairs if flag not in args for w in (flag, value)]


def _program(words: list[str]) -> list[str]:
    """The command's program as this interpreter runs it (the checkout's tensorpar, its torch)."""
    head = {"tensorpar": ["-m", "tensorpar"], "torchrun": ["-m", "torch.distributed.run"],
            "python": [], "python3": []}
    assert words[0] in head, f"{shlex.join(words)}: unknown program {words[0]!r}"
    return [sys.executable, *head[words[0]], *words[1:]]


def _argv(command: str, paths: dict[str, str]) -> list[str]:
    """A bash line's command, its placeholders filled in, made small."""
    words = [paths.get(w, w) for w in shlex.split(command)]
    at = tensorpar_at(words)
    assert at is not None, f"{command!r}: not a tensorpar command; run it or add it to NOT_RUN"
    return _program(words[:at + 2] + _small(words[at + 1], words[at + 2:]))


def _python_here(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python SCRIPT`` run in this process, as ``__main__`` (``runpy``), in ``cwd``: what it
    prints and its exit status, as a process run gives them. The ranks it starts (``tp.launch``)
    fork from the session's server, which has imported torch and transformers (conftest.py),
    instead of a new interpreter and a new server importing them again (4-8 s a program)."""
    import contextlib
    import io
    import runpy
    import traceback

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, path, env = sys.argv, list(sys.path), dict(os.environ)
    rng = _random_states()
    try:
        sys.argv, sys.path[0:0] = [script], [str(cwd)]
        with (contextlib.chdir(cwd), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            try:
                # by its full path: a rank imports it from there (multiprocessing's main fixup)
                runpy.run_path(str(cwd / script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # as a process would: the traceback on stderr, exit status 1
                traceback.print_exc(file=err)
                code = 1
    finally:  # what a process would have kept to itself: arguments, path, environment, RNGs
        sys.argv, sys.path[:] = argv, path
        os.environ.clear()
        os.environ.update(env)
        _set_random_states(rng)
    return subprocess.CompletedProcess([sys.executable, script], code, out.getvalue(),
                                       err.getvalue())


def _random_states() -> tuple:
    """The generators a program may draw from or seed: torch's, Python's and numpy's."""
    import random

    import numpy as np

    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_random_states(states: tuple) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def _run(argv: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
    torchrun = torchrun_args(argv[3:]) if argv[1:3] == ["-m", "torch.distributed.run"] else None
    if len(argv) == 2 and argv[1].endswith(".py"):  # python NAME.py
        out = _python_here(argv[1], cwd)
    elif torchrun:  # torchrun --standalone --nproc-per-node N NAME.py (or -m ...), forked
        out = torchrun_here(*torchrun, cwd, env())
    elif argv[1:3] == ["-m", "tensorpar"]:
        # ``tensorpar ARGS`` through the command's entry (``cli.main``) in this process, its
        # ranks forked from the session's fork server, which has imported what they need
        # (conftest.py): the 3-5 s a new Python spends importing torch and tensorpar, and its
        # server the same again, are the cost of every real run (tests/train/test_train_cli.py,
        # test_stop_resume.py, tests/test_cli.py, tests/hf run the commands as processes)
        out = tensorpar_here(*argv[3:], cwd=cwd)
    else:
        out = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True,
                             timeout=300)
    assert out.returncode == 0, (f"{what}\n$ {shlex.join(argv)}\nexit {out.returncode}\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _writes_only_runs(cwd: Path, own: set[str]) -> None:
    extra = sorted(set(os.listdir(cwd)) - own - {"runs"})
    assert not extra, f"an example wrote {extra} outside runs/"


def test_every_bash_line_runs_or_is_listed():
    """Each bash line is a tensorpar command (run by test_bash_line) or in NOT_RUN; NOT_RUN
    names only lines the docs still have; the make targets it lists exist (make -n)."""
    lines = [cmd for path in DOCS for _, cmd in bash_lines(path)]
    for cmd in lines:
        if cmd not in NOT_RUN:
            words = shlex.split(cmd)
            assert tensorpar_at(words) is not None, \
                f"README line {cmd!r} does not run here: make it a tensorpar command or list it " \
                "in NOT_RUN with the reason"
    assert not set(NOT_RUN) - set(lines), f"NOT_RUN lists {set(NOT_RUN) - set(lines)}: gone"
    for cmd in NOT_RUN:
        if cmd.startswith("make "):
            out = subprocess.run(["make", "-n", *shlex.split(cmd)[1:]], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("page,line,name,command,program,shown", python_blocks(),
                         ids=[f"{b[0]}:{b[1]}-{b[2]}" for b in python_blocks()])
def test_python_block(tmp_path, page, line, name, command, program, shown):
    """The block, saved as the file its first line names, runs with the command given there,
    writes nothing outside runs/, and prints what the page shows after it (the numbers within
    docs_compare's tolerances); it leaves this process's RNGs and environment as they were."""
    assert name in shlex.split(command), f"{page}:{line}: {command!r} does not run {name}"
    (tmp_path / name).write_text(program)
    before, env = _random_states(), dict(os.environ)
    out = _run(_program(shlex.split(command)), tmp_path, f"{page}:{line}")
    _writes_only_runs(tmp_path, {name})
    after = _random_states()
    assert torch.equal(before[0], after[0]) and before[1] == after[1], "an RNG leaked"
    assert all((a == b).all() if hasattr(a, "all") else a == b
               for a, b in zip(before[2], after[2], strict=True)), "numpy's RNG leaked"
    assert dict(os.environ) == env, "the environment leaked"
    if shown is not None:
        diff = differences(shown, out.stdout)
        assert not diff, f"{page}:{line}: {name} prints other numbers than the page shows\n" + \
            "\n".join(diff)


@pytest.mark.parametrize("page,line,command,shown", shown_commands(),
                         ids=[f"{c[0]}:{c[1]}" for c in shown_commands()])
def test_shown_command_output(tmp_path, page, line, command, shown):
    """A tensorpar command a page shows with its output (learn.md's plan) prints it now."""
    words = shlex.split(command)
    assert words[0] == "tensorpar", f"{page}:{line}: {command!r}"
    out = tensorpar_here(*words[1:], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    diff = differences(shown, out.stdout)
    assert not diff, f"{page}:{line}: {command} prints other numbers than the page shows\n" + \
        "\n".join(diff)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> str:
    """``path/to/model``: a tiny random Llama with a tokenizer (4 heads, 2 KV heads, width 64)."""
    import transformers  # the dev extra: missing is a broken install, not a skip
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


# "u:" or "a:" and the text, a line each (short: a character a token, the SMALL 32 a row); the
# generation prompt opens the assistant's line
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> str:
    """``path/to/chat.jsonl``: conversations, a user's question and the assistant's answer."""
    import json

    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    words = default_corpus()[:4_000].split()
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(words[i:i + 2])[:12]},
                {"role": "assistant", "content": words[i + 2][:8]}]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> str:
    """``path/to/held-out.txt``: a text the training files do not hold."""
    path = tmp_path_factory.mktemp("held-out") / "held-out.txt"
    path.write_text(default_corpus()[-20_000:])
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """``path/to/tokenizer``: a byte-level BPE tokenizer with an end-of-text token."""
    return str(bpe_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> str:
    """``path/to/corpus/*.txt``: three text files of Python's help text."""
    folder = tmp_path_factory.mktemp("corpus")
    text = default_corpus()
    for i in range(3):
        (folder / f"part{i}.txt").write_text(text[i * 20_000:(i + 1) * 20_000])
    return str(folder / "*.txt")


@pytest.fixture(scope="module")
def instructions(tmp_path_factory) -> str:
    """``path/to/instructions.jsonl``: prompt and completion pairs."""
    import json

    path = tmp_path_factory.mktemp("sft") / "instructions.jsonl"
    words = default_corpus()[:4_000].split()
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": " ".join(words[i:i + 6]),
                                "completion": " " + " ".join(words[i + 6:i + 9])}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def run_through(tmp_path_factory, request):
    """``run_through(group, i)``: runs lines 0..i of ``group`` ("README.md", or "docs": every
    page's lines in the site's order) in the group's directory, each once (a line's test runs
    the lines before it that did not run yet)."""
    cwds = {group: tmp_path_factory.mktemp(group.replace(".", "-")) for group in _RUN_LINES}
    done: dict[tuple[str, int], str | None] = {}  # line -> None (ran) or the failure

    def run(group: str, index: int) -> None:
        for i in range(index + 1):
            if (group, i) in done:
                continue
            page, no, cmd = _RUN_LINES[group][i]
            paths = {word: request.getfixturevalue(fixture)
                     for word, fixture in PLACEHOLDERS.items() if word in cmd}
            try:
                _run(_argv(cmd, paths), cwds[group], f"{page}:{no}: {cmd}")
                _writes_only_runs(cwds[group], set())
                done[group, i] = None
            except AssertionError as e:
                done[group, i] = str(e)
        assert done[group, index] is None, done[group, index]

    return run


def _line_id(page: str, no: int, cmd: str) -> str:
    words = shlex.split(cmd)
    at = tensorpar_at(words)
    return f"{page}:{no}-{words[at + 1] if at is not None else words[0]}"


def _words(cmd: str) -> tuple[str, ...]:
    return tuple(sorted(shlex.split(cmd)))


_DOCS_LINES = [(page_name(path), no, cmd) for path in DOCS[1:] for no, cmd in bash_lines(path)
               if cmd not in NOT_RUN]
# a README line that a docs page runs with the same words runs there, in the page's order (the
# README's train, resume, generate and plan lines are the training and learner's pages' own)
_RUN_LINES = {"README.md": [("README.md", no, cmd) for no, cmd in bash_lines(README)
                            if cmd not in NOT_RUN
                            and _words(cmd) not in {_words(c) for *_, c in _DOCS_LINES}],
              "docs": _DOCS_LINES}
_RUN_LINES = {group: lines for group, lines in _RUN_LINES.items() if lines}
_CASES = [(group, i) for group, lines in _RUN_LINES.items() for i in range(len(lines))]


@pytest.mark.slow
@pytest.mark.parametrize("group,index", _CASES,
                         ids=[_line_id(*_RUN_LINES[g][i]) for g, i in _CASES])
def test_bash_line(run_through, group, index):
    """The line runs (small: see SMALL and STEP_SCALE) after the lines of its group before it,
    exit code 0, and writes nothing outside runs/."""
    run_through(group, index)


