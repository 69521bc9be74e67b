"""Small things the command line says plainly: flags in full (no abbreviations), a prompt file
that cannot be read, counts in the singular."""

import pytest

from tensorpar.data.prepare import summary

from tests_common import tensorpar_here


@pytest.mark.parametrize("argv", [["train", "--micro-batch", "2"], ["plan", "--mod", "x"],
                                  ["generate", "--temp", "0.5", "--hf", "x"]])
def test_abbreviated_flags_are_refused(argv):
    """argparse's abbreviations are off: --micro-batch is not --micro-batch-size."""
    r = tensorpar_here(*argv)
    assert r.returncode == 2 and f"unrecognized arguments: {argv[1]}" in r.stderr, r.stderr


def test_prompt_file_that_cannot_be_read_is_one_line(tmp_path):
    """A folder, a missing file, bytes that are not UTF-8: one line each, no errno text."""
    (tmp_path / "bin.txt").write_bytes(b"ok\xff\n")
    for path, said in ((tmp_path, f"--prompt-file {tmp_path} is a folder: expected a UTF-8 "
                                  "file of prompts, one a line"),
                       (tmp_path / "none.txt", f"--prompt-file {tmp_path / 'none.txt'}: no such "
                                               "file"),
                       (tmp_path / "bin.txt", f"--prompt-file {tmp_path / 'bin.txt'}: not UTF-8 "
                                              "text (byte 0xff at offset 2)")):
        r = tensorpar_here("generate", "--hf", tmp_path, "--prompt-file", path)
        assert r.returncode == 2 and r.stderr == f"tensorpar generate: {said}\n", r.stderr


def test_prepare_counts_one_document_in_the_singular():
    index = {"documents": 1, "tokens": 12, "dtype": "uint16", "shards": ["a"], "sources": [{}],
             "seconds": 0.1, "tokens_per_second": 120}
    assert summary("out", index).startswith("tensorpar prepare: wrote out: 1 document, 12 "
                                            "tokens (uint16, 1 shard) from 1 file")
