"""The README's examples run as written.

Every ```python block is a whole program whose first line says how to run it
(``# NAME.py: run with `COMMAND` ``); it is saved as NAME.py in an empty directory and run with
that command (``torchrun`` as ``python -m torch.distributed.run``). Every line of a ```bash block
either runs here, in README order in one directory, so that resume, generate, export and plan
find what train wrote, or is in ``NOT_RUN`` with the reason; a ``tensorpar`` line runs through
``cli.main`` in this process (``_run``), others as processes. A line that runs keeps its words;
only flags that make it small are added (``SMALL``), step counts are divided by ``STEP_SCALE``
(``--steps 800`` and ``step-00000800`` alike) and placeholder paths (``PLACEHOLDERS``) are
filled in. Examples write under ``runs/`` only, never into the repository.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests_common import char_tokenizer, tensorpar_here

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# Lines of the README's bash blocks that do not run here, each with the reason. A line neither
# run nor listed fails test_every_bash_line_runs_or_is_listed.
NOT_RUN = {
    "make demo": "installs the pinned packages, then trains the default model for 400 steps "
                 "(~4 min); its train and generate commands run below, small, as the README's "
                 "own tensorpar lines (make -n checks the target)",
    "make test": "runs the whole suite, this test included (make -n checks the target)",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
    "--rdzv-id job1 -m tensorpar train --tp 8 --out /shared/runs/gpt":
        "needs two machines of 8 ranks each; tests/dp/test_multinode.py runs the same two-node "
        "rendezvous on this machine (2 x 2 ranks)",
}

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
PLACEHOLDERS = {"path/to/model": "hf_model"}


def _blocks() -> list[tuple[str, int, str]]:
    """(language, line number of the opening fence, text) of every fenced block."""
    blocks, lang, start, body = [], None, 0, []
    for no, line in enumerate(README.read_text().splitlines(), 1):
        if lang is None and line.startswith("```"):
            lang, start, body = line[3:].strip(), no, []
        elif lang is not None and line.startswith("```"):
            blocks.append((lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"README.md:{start}: unclosed ``` block"
    return blocks


def _strip_comment(line: str) -> str:
    """The command without its trailing ``# comment`` (a # outside quotes, after a space)."""
    for m in re.finditer(r"\s#", line):
        head = line[:m.start()]
        if head.count('"') % 2 == 0 and head.count("'") % 2 == 0:
            return head.strip()
    return line.strip()


def _bash_lines() -> list[tuple[int, str]]:
    """(README line number, command) of every command in the bash blocks, comments dropped."""
    found, pending = [], ""
    for lang, start, text in _blocks():
        if lang == "bash":
            for i, line in enumerate(text.splitlines(), start + 1):
                if line.endswith("\\"):  # continued on the next line
                    pending += line[:-1]
                    continue
                line, pending = pending + line, ""
                if _strip_comment(line) and not line.lstrip().startswith("#"):
                    found.append((i, _strip_comment(line)))
    return found


def _python_blocks() -> list[tuple[int, str, str, str]]:
    """(README line number, file name, run command, program) of every python block."""
    found = []
    for lang, start, text in _blocks():
        if lang == "python":
            m = re.match(r"# (\w+\.py): run with `([^`]+)`", text)
            assert m, (f"README.md:{start}: a python block starts with "
                       "'# NAME.py: run with `COMMAND`'")
            found.append((start, m[1], m[2], text))
    return found


def _tensorpar_at(words: list[str]) -> int | None:
    """Index of the word ``tensorpar`` that starts the tensorpar command, or None."""
    if words[0] == "tensorpar":
        return 0
    for i in range(1, len(words)):
        if words[i] == "tensorpar" and words[i - 1] == "-m":
            return i
    return None


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
            return args + SMALL_RUN
    return args + SMALL.get(sub, [])


def _program(words: list[str]) -> list[str]:
    """The command's program as this interpreter runs it (the checkout's tensorpar, its torch)."""
    head = {"tensorpar": ["-m", "tensorpar"], "torchrun": ["-m", "torch.distributed.run"],
            "python": [], "python3": []}
    assert words[0] in head, f"{shlex.join(words)}: unknown program {words[0]!r}"
    return [sys.executable, *head[words[0]], *words[1:]]


def _argv(command: str, paths: dict[str, str]) -> list[str]:
    """A bash line's command, its placeholders filled in, made small."""
    words = [paths.get(w, w) for w in shlex.split(command)]
    at = _tensorpar_at(words)
    assert at is not None, f"{command!r}: not a tensorpar command; run it or add it to NOT_RUN"
    return _program(words[:at + 2] + _small(words[at + 1], words[at + 2:]))


def _env() -> dict[str, str]:
    """This checkout first on the path; no launcher environment inherited from pytest's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run(argv: list[str], cwd: Path, what: str) -> None:
    if argv[1:3] == ["-m", "tensorpar"]:
        # ``tensorpar ARGS`` through the command's entry (``cli.main``) in this process, its
        # ranks forked from the session's fork server, which has imported what they need
        # (conftest.py): the 3-5 s a new Python spends importing torch and tensorpar, and its
        # server the same again, are the cost of every real run (tests/train/test_train_cli.py,
        # test_stop_resume.py, tests/test_cli.py, tests/hf run the commands as processes)
        out = tensorpar_here(*argv[3:], cwd=cwd)
    else:
        out = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                             timeout=300)
    assert out.returncode == 0, (f"{what}\n$ {shlex.join(argv)}\nexit {out.returncode}\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def _writes_only_runs(cwd: Path, own: set[str]) -> None:
    extra = sorted(set(os.listdir(cwd)) - own - {"runs"})
    assert not extra, f"an example wrote {extra} outside runs/"


def test_every_bash_line_runs_or_is_listed():
    """Each bash line is a tensorpar command (run by test_bash_line) or in NOT_RUN; NOT_RUN
    names only lines the README still has; the make targets it lists exist (make -n)."""
    lines = [cmd for _, cmd in _bash_lines()]
    for cmd in lines:
        if cmd not in NOT_RUN:
            words = shlex.split(cmd)
            assert _tensorpar_at(words) is not None, \
                f"README line {cmd!r} does not run here: make it a tensorpar command or list it " \
                "in NOT_RUN with the reason"
    assert not set(NOT_RUN) - set(lines), f"NOT_RUN lists {set(NOT_RUN) - set(lines)}: gone"
    for cmd in NOT_RUN:
        if cmd.startswith("make "):
            out = subprocess.run(["make", "-n", *shlex.split(cmd)[1:]], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("line,name,command,program", _python_blocks(),
                         ids=[f"line{b[0]}-{b[1]}" for b in _python_blocks()])
def test_python_block(tmp_path, line, name, command, program):
    """The block, saved as the file its first line names, runs with the command given there and
    writes nothing outside runs/."""
    assert name in shlex.split(command), f"README.md:{line}: {command!r} does not run {name}"
    if re.search(r"^(from|import) transformers", program, re.M):
        pytest.importorskip("transformers")
    (tmp_path / name).write_text(program)
    _run(_program(shlex.split(command)), tmp_path, f"README.md:{line}")
    _writes_only_runs(tmp_path, {name})


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> str:
    """``path/to/model``: a tiny random Llama with a tokenizer (4 heads, 2 KV heads, width 64)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def readme_cwd(tmp_path_factory, request):
    """One directory for all bash lines, and ``run_through(i)``: runs lines 0..i there in README
    order, each once (a line's test runs the lines before it that did not run yet)."""
    cwd = tmp_path_factory.mktemp("readme")
    done: dict[int, str | None] = {}  # line index -> None (ran) or the failure

    def run_through(index: int) -> None:
        for i in range(index + 1):
            if i in done:
                continue
            no, cmd = _RUN_LINES[i]
            paths = {word: request.getfixturevalue(fixture)
                     for word, fixture in PLACEHOLDERS.items() if word in cmd}
            try:
                _run(_argv(cmd, paths), cwd, f"README.md:{no}: {cmd}")
                _writes_only_runs(cwd, set())
                done[i] = None
            except AssertionError as e:
                done[i] = str(e)
        assert done[index] is None, done[index]

    return run_through


def _line_id(no: int, cmd: str) -> str:
    words = shlex.split(cmd)
    at = _tensorpar_at(words)
    return f"line{no}-{words[at + 1] if at is not None else words[0]}"


_RUN_LINES = [(no, cmd) for no, cmd in _bash_lines() if cmd not in NOT_RUN]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_RUN_LINES)),
                         ids=[_line_id(no, cmd) for no, cmd in _RUN_LINES])
def test_bash_line(readme_cwd, index):
    """The README line runs (small: see SMALL and STEP_SCALE) after the lines before it, exit
    code 0, and writes nothing outside runs/."""
    readme_cwd(index)
