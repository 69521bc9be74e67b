"""Write docs/cli.md, the reference of every ``tensorpar`` command and flag, from the parsers
themselves: `python docs/gen_cli.py [FILE]` (default docs/cli.md). tests/test_docs.py generates
it again and fails when the page differs: a flag added, renamed or re-documented in the code
shows up here by running this script, never by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVERY_COMMAND = "every command"  # the title of the flags every command takes (cli/main.py)

INTRO = """\
# CLI reference

Every `tensorpar` command and every flag, with its help as `tensorpar COMMAND --help` prints it.
Generated from the parsers by `python docs/gen_cli.py` (the suite regenerates it and fails on
any difference). `python -m tensorpar` is the same program. The train flags are the fields of
the trainer's and the GPT's config dataclasses, one per field. A boolean flag lists its
negation (`--compile`, `--no-compile`) where it has one. Every command also takes the flags of
[every command](#every-command), before the command's name or after it.
"""


def _flag(action: argparse.Action) -> str:
    """``--name VALUE`` (and its aliases), as the usage line writes it."""
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices is not None:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        value = action.metavar or action.dest.upper()
    if isinstance(value, tuple):
        value = " ".join(value)
    return f"{names} `{value}`" if action.nargs != "*" else f"{names} `[{value} ...]`"


def _help(action: argparse.Action) -> str:
    """The help text on one line, as Markdown shows it as written (``*``, ``_``, ``<``)."""
    text = " ".join((action.help or "").split())
    text = text.replace("%%", "%").replace("%(default)s", str(action.default))
    for c in "\\*<>":  # Markdown leaves the underscores inside words alone
        text = text.replace(c, "\\" + c)
    return text


def _options(actions) -> list[str]:
    lines = []
    for a in actions:
        if not a.option_strings or a.help == argparse.SUPPRESS or "-h" in a.option_strings:
            continue
        lines.append(f"- {_flag(a)}: {_help(a)}")
    return lines


def _positionals(parser: argparse.ArgumentParser) -> list[str]:
    return [f"- `{a.metavar or a.dest}` (positional): {_help(a)}" for a in parser._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def _own_groups(parser: argparse.ArgumentParser):
    """The parser's argument groups but the one every command shares."""
    return [g for g in parser._action_groups if g.title != EVERY_COMMAND]


def reference() -> str:
    """The page's text."""
    from tensorpar.cli.main import build_parser

    main = build_parser()
    sub = next(a for a in main._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = [INTRO]
    for name, parser in sub.choices.items():
        out += [f"## tensorpar {name}", "", f"{helps.get(name, '').rstrip('.')}.", ""]
        out += _positionals(parser)
        for group in _own_groups(parser):
            lines = _options(group._group_actions)
            if not lines:
                continue
            if group.title not in ("options", "optional arguments"):
                out += ["", f"### {name}: {group.title}", ""]
            out += lines
        out.append("")
    shared = next(g for g in main._action_groups if g.title == EVERY_COMMAND)
    out += ["## Every command", "",
            "Before the command's name (`tensorpar --timeout 60 train`) or after it.", ""]
    out += _options(shared._group_actions)
    out += ["", " ".join(main.epilog.split())]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "cli.md"
    target.write_text(reference())
    print(f"wrote {target}")
