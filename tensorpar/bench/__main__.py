"""``python -m tensorpar.bench [flags]``: the same as ``tensorpar bench [flags]``."""

import argparse
import shlex
import sys

from tensorpar.cli.bench import add_parser, main

parser = argparse.ArgumentParser(prog="python -m tensorpar.bench", allow_abbrev=False)
sub = parser.add_subparsers(dest="command")
add_parser(sub).allow_abbrev = False
args = parser.parse_args(["bench", *sys.argv[1:]])
args.command_line = "tensorpar bench " + shlex.join(sys.argv[1:])
sys.exit(main(args))
