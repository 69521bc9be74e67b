"""The README's and the docs pages' text as the doc tests read it: the pages in the site's order,
their fenced blocks, the commands of their bash blocks, the programs of their python blocks and
the output a page shows after a block.

Every ```python block of README.md and docs/*.md is a whole program whose first line says how
to run it (``# NAME.py: run with `COMMAND` ``). A ```text block right after a python block, or
after a bash block of one command, is what the page shows it print (``shown_after``).
"""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def nav_pages() -> list[Path]:
    """The docs pages in the site's order (mkdocs.yml's nav: one ``- Title: page.md`` a line)."""
    names = re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [ROOT / "docs" / n for n in names]


DOCS = [README, *nav_pages()]

# Lines of the README's bash blocks that do not run here, each with the reason. A line neither
# run nor listed fails test_every_bash_line_runs_or_is_listed.
NOT_RUN = {
    "make demo": "installs the pinned packages, then trains the default model for 400 steps "
                 "(~4 min); its train and generate commands run small as the training page's "
                 "lines (make -n checks the target)",
    "make test": "runs the whole suite, this test included (make -n checks the target)",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
    "--rdzv-id job1 -m tensorpar train --tp 8 --out /shared/runs/gpt":
        "needs two machines of 8 ranks each; tests/dp/test_multinode.py runs the same two-node "
        "rendezvous on this machine (2 x 2 ranks)",
    "tensorpar train --hf path/to/qwen3-moe --tp 2 --dp 2 --ep 4 --steps 100 --out runs/moe-ft":
        "needs a Qwen3-MoE checkpoint; tests/hf/test_hf_moe.py trains the same layout on a tiny "
        "Qwen3-MoE and compares it with one rank",
}


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line number of the opening fence, text) of every fenced block of ``path``."""
    found, lang, start, body = [], None, 0, []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if lang is None and line.startswith("```"):
            lang, start, body = line[3:].strip(), no, []
        elif lang is not None and line.startswith("```"):
            found.append((lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{page_name(path)}:{start}: unclosed ``` block"
    return found


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def strip_comment(line: str) -> str:
    """The command without its trailing ``# comment`` (a # outside quotes, after a space)."""
    for m in re.finditer(r"\s#", line):
        head = line[:m.start()]
        if head.count('"') % 2 == 0 and head.count("'") % 2 == 0:
            return head.strip()
    return line.strip()


def bash_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of every command in ``path``'s bash blocks, comments dropped."""
    found, pending = [], ""
    for lang, start, text in fenced_blocks(path):
        if lang == "bash":
            for i, line in enumerate(text.splitlines(), start + 1):
                if line.endswith("\\"):  # continued on the next line
                    pending += line[:-1]
                    continue
                line, pending = pending + line, ""
                if strip_comment(line) and not line.lstrip().startswith("#"):
                    found.append((i, strip_comment(line)))
    return found


def shown_after(blocks, i: int) -> str | None:
    """The ```text block right after block i (one blank line between): what the page shows
    block i print; None when there is none, or when it leaves lines out (``...``)."""
    lang, start, text = blocks[i]
    end = start + text.count("\n") + 1  # the closing fence's line
    if i + 1 < len(blocks):
        nxt_lang, nxt_start, nxt_text = blocks[i + 1]
        if nxt_lang == "text" and nxt_start == end + 2 and "..." not in nxt_text:
            return nxt_text
    return None


def python_blocks() -> list[tuple[str, int, str, str, str, str | None]]:
    """(page, line number, file name, run command, program, the output the page shows or None)
    of every python block; a program that a page before it shows word for word (the README's,
    again in the docs) runs once."""
    found, seen = [], set()
    for path in DOCS:
        blocks = fenced_blocks(path)
        for i, (lang, start, text) in enumerate(blocks):
            if lang == "python" and text not in seen:
                seen.add(text)
                m = re.match(r"# (\w+\.py): run with `([^`]+)`", text)
                assert m, (f"{page_name(path)}:{start}: a python block starts with "
                           "'# NAME.py: run with `COMMAND`'")
                found.append((page_name(path), start, m[1], m[2], text, shown_after(blocks, i)))
    return found


def shown_commands() -> list[tuple[str, int, str, str]]:
    """(page, line number, command, output shown) of every bash block of one tensorpar
    command followed by the output the page shows it print."""
    found = []
    for path in DOCS:
        blocks = fenced_blocks(path)
        for i, (lang, start, text) in enumerate(blocks):
            lines = [line for line in text.splitlines() if line.strip()]
            shown = shown_after(blocks, i) if lang == "bash" and len(lines) == 1 else None
            if shown is not None:
                found.append((page_name(path), start, strip_comment(lines[0]), shown))
    return found


def tensorpar_at(words: list[str]) -> int | None:
    """Index of the word ``tensorpar`` that starts the tensorpar command, or None."""
    if words[0] == "tensorpar":
        return 0
    for i in range(1, len(words)):
        if words[i] == "tensorpar" and words[i - 1] == "-m":
            return i
    return None



def env() -> dict[str, str]:
    """This checkout first on the path; no launcher environment inherited from pytest's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


