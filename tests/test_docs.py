"""The README's and the docs' examples run as written, the docs site builds strictly, and every
flag the docs name exists.

Every ```python block of README.md and docs/*.md is a whole program whose first line says how
to run it (``# NAME.py: run with `COMMAND` ``); it is saved as NAME.py in an empty directory and
run with that command (``torchrun`` as ``python -m torch.distributed.run``; ``python NAME.py``
in this process, as ``__main__``, its ranks forked from the session's server: ``_python_here``).
Every line of a ```bash block either runs here, in order, or is in ``NOT_RUN`` with the reason;
a ``tensorpar`` line runs through ``cli.main`` in this process (``_run``), others as processes.
A line that runs keeps its words; only flags that make it small are added (``SMALL``), step
counts are divided by ``STEP_SCALE`` (``--steps 800`` and ``step-00000800`` alike) and
placeholder paths (``PLACEHOLDERS``) are filled in. Examples write under ``runs/`` only, never
into the repository. The README's lines run in a directory of their own; the docs pages' in one
directory shared in the site's order (``mkdocs.yml``'s nav), so that a page finds what an
earlier one trained (the planner's page plans the run the training page wrote).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorpar.data.text import default_corpus

from tests_common import bpe_tokenizer, char_tokenizer, tensorpar_here

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _nav_pages() -> list[Path]:
    """The docs pages in the site's order (mkdocs.yml's nav: one ``- Title: page.md`` a line)."""
    names = re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [ROOT / "docs" / n for n in names]


DOCS = [README, *_nav_pages()]

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
PLACEHOLDERS = {"path/to/model": "hf_model", "path/to/tokenizer": "tokenizer_dir",
                "path/to/corpus/*.txt": "text_files",
                "path/to/instructions.jsonl": "instructions"}


def _blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line number of the opening fence, text) of every fenced block of ``path``."""
    blocks, lang, start, body = [], None, 0, []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if lang is None and line.startswith("```"):
            lang, start, body = line[3:].strip(), no, []
        elif lang is not None and line.startswith("```"):
            blocks.append((lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{_name(path)}:{start}: unclosed ``` block"
    return blocks


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _strip_comment(line: str) -> str:
    """The command without its trailing ``# comment`` (a # outside quotes, after a space)."""
    for m in re.finditer(r"\s#", line):
        head = line[:m.start()]
        if head.count('"') % 2 == 0 and head.count("'") % 2 == 0:
            return head.strip()
    return line.strip()


def _bash_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of every command in ``path``'s bash blocks, comments dropped."""
    found, pending = [], ""
    for lang, start, text in _blocks(path):
        if lang == "bash":
            for i, line in enumerate(text.splitlines(), start + 1):
                if line.endswith("\\"):  # continued on the next line
                    pending += line[:-1]
                    continue
                line, pending = pending + line, ""
                if _strip_comment(line) and not line.lstrip().startswith("#"):
                    found.append((i, _strip_comment(line)))
    return found


def _python_blocks() -> list[tuple[str, int, str, str, str]]:
    """(page, line number, file name, run command, program) of every python block; a program
    that a page before it shows word for word (the README's, again in the docs) runs once."""
    found, seen = [], set()
    for path in DOCS:
        for lang, start, text in _blocks(path):
            if lang == "python" and text not in seen:
                seen.add(text)
                m = re.match(r"# (\w+\.py): run with `([^`]+)`", text)
                assert m, (f"{_name(path)}:{start}: a python block starts with "
                           "'# NAME.py: run with `COMMAND`'")
                found.append((_name(path), start, m[1], m[2], text))
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
    at = _tensorpar_at(words)
    assert at is not None, f"{command!r}: not a tensorpar command; run it or add it to NOT_RUN"
    return _program(words[:at + 2] + _small(words[at + 1], words[at + 2:]))


def _env() -> dict[str, str]:
    """This checkout first on the path; no launcher environment inherited from pytest's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


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
    argv, path = sys.argv, list(sys.path)
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
    finally:
        sys.argv, sys.path[:] = argv, path
    return subprocess.CompletedProcess([sys.executable, script], code, out.getvalue(),
                                       err.getvalue())


def _run(argv: list[str], cwd: Path, what: str) -> None:
    if len(argv) == 2 and argv[1].endswith(".py"):  # python NAME.py
        out = _python_here(argv[1], cwd)
    elif argv[1:3] == ["-m", "tensorpar"]:
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
    names only lines the docs still have; the make targets it lists exist (make -n)."""
    lines = [cmd for path in DOCS for _, cmd in _bash_lines(path)]
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


@pytest.mark.parametrize("page,line,name,command,program", _python_blocks(),
                         ids=[f"{b[0]}:{b[1]}-{b[2]}" for b in _python_blocks()])
def test_python_block(tmp_path, page, line, name, command, program):
    """The block, saved as the file its first line names, runs with the command given there and
    writes nothing outside runs/."""
    assert name in shlex.split(command), f"{page}:{line}: {command!r} does not run {name}"
    if re.search(r"^(from|import) transformers", program, re.M):
        pytest.importorskip("transformers")
    (tmp_path / name).write_text(program)
    _run(_program(shlex.split(command)), tmp_path, f"{page}:{line}")
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
def tokenizer_dir(tmp_path_factory) -> str:
    """``path/to/tokenizer``: a byte-level BPE tokenizer with an end-of-text token."""
    pytest.importorskip("transformers")
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
    at = _tensorpar_at(words)
    return f"{page}:{no}-{words[at + 1] if at is not None else words[0]}"


def _words(cmd: str) -> tuple[str, ...]:
    return tuple(sorted(shlex.split(cmd)))


_DOCS_LINES = [(_name(path), no, cmd) for path in DOCS[1:] for no, cmd in _bash_lines(path)
               if cmd not in NOT_RUN]
# a README line that a docs page runs with the same words runs there, in the page's order (the
# README's train, resume, generate and plan lines are the training and learner's pages' own)
_RUN_LINES = {"README.md": [("README.md", no, cmd) for no, cmd in _bash_lines(README)
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


# flags of other programs the docs name (torchrun, pip, pytest, make, tensorboard, git)
OTHER_FLAGS = {"--standalone", "--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint",
               "--rdzv-id", "--no-deps", "--index-url", "--durations", "--logdir", "--strict",
               "--site-dir"}


def _tensorpar_flags() -> set[str]:
    """Every option of ``tensorpar`` and of each of its commands."""
    from tensorpar.cli.main import build_parser

    parser, flags = build_parser(), set()
    commands = parser._subparsers._group_actions[0].choices.values()
    for p in (parser, *commands):
        flags |= {s for a in p._actions for s in a.option_strings if s.startswith("--")}
    return flags


def test_every_flag_the_docs_name_exists():
    """A ``--flag`` written anywhere in the README or the docs is an option of ``tensorpar`` or
    of one of its commands (as ``--help`` lists them), or a flag of another program the docs
    name (OTHER_FLAGS), with ``--no-X`` for a boolean ``--X``."""
    known = _tensorpar_flags() | OTHER_FLAGS
    unknown = set()
    for path in DOCS:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", path.read_text()):
            if flag not in known:
                unknown.add(f"{_name(path)}: {flag}")
    assert not unknown, sorted(unknown)


def test_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: every page in the nav, every link resolving, the API reference
    generated from the docstrings without a warning."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, env=_env() | {
                              "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_docs_keep_dates_and_issue_numbers_out():
    """Prose carries no dates and no internal issue numbers: measurements cite the dated reports
    of benchmarks/ by file name; the README at most 250 lines."""
    assert len(README.read_text().splitlines()) <= 250
    for path in DOCS:
        text = re.sub(r"benchmarks/(reports|results)/[\w./-]+", "", path.read_text())
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), _name(path)
        assert not re.search(r"\b[Ii]ssue \d+", text), _name(path)


def test_figures_are_drawn_by_the_script(tmp_path):
    """docs/figures/*.png are what ``python docs/figures/draw.py`` draws now, byte for byte:
    regenerated, not pasted; and every figure the docs show is one of them."""
    figures = ROOT / "docs" / "figures"
    subprocess.run([sys.executable, str(figures / "draw.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert drawn == {p.name for p in figures.glob("*.png")}
    for name in drawn:
        assert (tmp_path / name).read_bytes() == (figures / name).read_bytes(), name
    shown = {m for path in DOCS
             for m in re.findall(r"\(figures/([\w.-]+\.png)\)", path.read_text())}
    assert shown <= drawn, shown - drawn
