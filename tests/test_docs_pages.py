"""The docs pages as text: every flag they name exists, and where they write a command with
flags, the flags are that command's; every tensorpar line they show parses; the CLI reference is
the parsers' own (docs/gen_cli.py); the site builds strictly; no dates or issue numbers in prose;
the figures are what docs/figures/draw.py draws.
"""

import re
import shlex
import subprocess
import sys

from docs_source import (
    DOCS,
    NOT_RUN,
    README,
    ROOT,
    bash_lines,
    env,
    fenced_blocks,
    page_name,
    tensorpar_at,
)

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
                unknown.add(f"{page_name(path)}: {flag}")
    assert not unknown, sorted(unknown)


def _command_parsers() -> dict:
    """``tensorpar``'s parser of each command, by name."""
    from tensorpar.cli.main import build_parser

    return dict(build_parser()._subparsers._group_actions[0].choices)


def _flags_of(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_the_flags_a_command_is_shown_with_are_its_own():
    """Where a page writes a command with flags (``tensorpar plan --devices 64`` in a code span
    or a bash line, or ``verify --seq-len`` in prose), each flag is one that command's parser
    takes (its --help lists it): a flag of another command does not pass for it."""
    parsers = _command_parsers()
    flags = {name: _flags_of(p) for name, p in parsers.items()}
    wrong = set()
    for path in DOCS:
        text = path.read_text()
        spans = re.findall(r"`([^`\n]+)`", text) + [c for _, c in bash_lines(path)]
        for span in spans:
            m = re.match(r"(?:(?:python -m )?tensorpar )?(\w+) (.*)", span)
            if m and m[1] in flags and ("tensorpar" in span or m[2].startswith("--")):
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", m[2]):
                    if flag not in flags[m[1]]:
                        wrong.add(f"{page_name(path)}: `{span}`: {m[1]} has no {flag}")
    assert not wrong, sorted(wrong)


def test_verify_spells_the_head_flags_as_train():
    """``verify --n-head`` and ``--n-kv-head`` are train's names for the same sizes; the
    dataclass's ``--num-heads`` and ``--num-kv-heads`` stay as aliases."""
    verify = _command_parsers()["verify"]
    new = verify.parse_args(["--n-head", "4", "--n-kv-head", "1"])
    old = verify.parse_args(["--num-heads", "4", "--num-kv-heads", "1"])
    assert (new.num_heads, new.num_kv_heads) == (old.num_heads, old.num_kv_heads) == (4, 1)
    assert {"--n-head", "--n-kv-head"} <= _flags_of(_command_parsers()["train"])


def test_every_tensorpar_line_parses():
    """Every tensorpar line of the README's and the docs' bash blocks, its placeholders left as
    they are, is accepted by ``tensorpar``'s parser as written (the slow test_bash_line runs
    them; this catches a renamed or removed flag in the fast tier)."""
    import contextlib
    import io

    from tensorpar.cli.main import build_parser

    bad = []
    for path in DOCS:
        for no, cmd in bash_lines(path):
            words = shlex.split(cmd)
            at = tensorpar_at(words)
            if at is None or cmd in NOT_RUN:
                continue
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    build_parser().parse_args(words[at + 1:])
            except SystemExit:
                bad.append(f"{page_name(path)}:{no}: {cmd}\n  {err.getvalue().strip()[-300:]}")
    assert not bad, "\n".join(bad)


def test_cli_reference_is_generated():
    """docs/cli.md is what ``python docs/gen_cli.py`` writes from the parsers now: every command
    and every flag with its help (a flag added or re-documented without regenerating fails)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "cli.md").read_text() == gen.reference(), \
        "docs/cli.md is stale: run python docs/gen_cli.py"
    train = _command_parsers()["train"]
    text = (ROOT / "docs" / "cli.md").read_text()
    missing = {f for f in _flags_of(train) - {"--help"} if f"`{f}`" not in text}
    assert not missing, f"train flags missing: {sorted(missing)}"


def test_quoted_code_is_the_code():
    """A ```py block (code a page quotes, not a program to run) is the file it names word for
    word: each of its paragraphs (lines between blank lines) is in the file named in the
    sentence before the block (``tensorpar/...py``), as written."""
    quoted = 0
    for path in DOCS:
        text = path.read_text()
        for lang, start, body in fenced_blocks(path):
            if lang != "py":
                continue
            before = "\n".join(text.splitlines()[max(0, start - 4):start - 1])
            m = re.search(r"`(tensorpar/[\w/]+\.py)`", before)
            assert m, f"{page_name(path)}:{start}: name the quoted file just before the block"
            source = (ROOT / m[1]).read_text()
            for part in re.split(r"\n\s*\n", body.strip("\n")):
                assert part in source, f"{page_name(path)}:{start}: not in {m[1]}:\n{part}"
                quoted += 1
    assert quoted, "learn.md quotes f and g"


def test_cited_tests_exist_and_tested_footers_list_them():
    """Every test file a page cites (``tests/...py``) exists; a page with a "Tested" footer lists
    there every test file it cites anywhere."""
    missing, unlisted = [], []
    for path in DOCS:
        text = path.read_text()
        cited = set(re.findall(r"tests/[\w/]+\.py", text))
        missing += [f"{page_name(path)}: {t}" for t in sorted(cited) if not (ROOT / t).is_file()]
        if "\n## Tested\n" in text:
            footer = set(re.findall(r"tests/[\w/]+\.py", text.split("\n## Tested\n")[1]))
            unlisted += [f"{page_name(path)}: {t}" for t in sorted(cited - footer)]
    assert not missing, f"cited test files that do not exist: {missing}"
    assert not unlisted, f"cited but not in the page's Tested footer: {unlisted}"


def test_cited_source_files_exist():
    """Every file or folder of the package a page names (``tensorpar/train/loop.py``,
    ``tensorpar/mesh/``) exists: a module moved or renamed fails here until the pages follow."""
    missing = []
    for path in DOCS:
        for cited in set(re.findall(r"\btensorpar/[\w/]*[\w]+(?:\.py|/)", path.read_text())):
            if not (ROOT / cited).exists():
                missing.append(f"{page_name(path)}: {cited}")
    assert not missing, sorted(missing)


def test_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: every page in the nav, every link resolving, the API reference
    generated from the docstrings without a warning."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, env=env() | {
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
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), page_name(path)
        assert not re.search(r"\b[Ii]ssue \d+", text), page_name(path)


FIGURE_TOLERANCE = 0.01  # mean absolute difference of the pixels, on 0..1 (text antialiasing)


def test_figures_are_drawn_by_the_script(tmp_path):
    """docs/figures/*.png are what ``python docs/figures/draw.py`` draws now: regenerated, not
    pasted. Compared as pixels (the same size; the mean absolute difference of the channels
    at most FIGURE_TOLERANCE), not bytes: another matplotlib or freetype draws the same figure
    with other bytes and slightly other antialiasing. Every figure the docs show is one of them."""
    import matplotlib.image as mpimg
    import numpy as np

    figures = ROOT / "docs" / "figures"
    subprocess.run([sys.executable, str(figures / "draw.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=300)
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert drawn == {p.name for p in figures.glob("*.png")}
    for name in sorted(drawn):
        new, kept = mpimg.imread(tmp_path / name), mpimg.imread(figures / name)
        assert new.shape == kept.shape, (name, new.shape, kept.shape)
        diff = float(np.abs(new - kept).mean())
        assert diff <= FIGURE_TOLERANCE, f"{name}: mean pixel difference {diff:.4f}"
    shown = {m for path in DOCS
             for m in re.findall(r"\(figures/([\w.-]+\.png)\)", path.read_text())}
    assert shown <= drawn, shown - drawn
