"""Errors on ranks told apart: an expected error (ValueError, OSError, FloatingPointError) comes
back as one line naming the rank and the cause, a bug with its traceback; ``tensorpar`` prints
the line (exit 1), the tracebacks only for a bug or with ``--debug`` / ``TENSORPAR_DEBUG=1``."""

import errno
import signal

import pytest
import torch.distributed as dist
from safetensors import SafetensorError

from tensorpar.checkpoint.save import _io_error
from tensorpar.cli import main as cli
from tensorpar.cli import train as cli_train
from tensorpar.ranks.failures import RankError, RankFailure, describe


def _raise(kinds: dict):
    """Raise on this rank what ``kinds`` says for it (rank -> exception), else return."""
    e = kinds.get(dist.get_rank())
    if e is not None:
        raise e
    return "fine"


def test_expected_errors_in_one_line(ranks):
    """The same full disk on both ranks: one line for both; different expected errors: one
    part per rank; every failure carries its rank, type, message and traceback."""
    full = OSError(errno.ENOSPC, "No space left on device", "/run/.step-00000004.tmp/r.safetensors")
    with pytest.raises(RankError) as err:
        ranks(2).run(_raise, {0: full, 1: full})
    assert err.value.expected
    assert err.value.one_line() == ("ranks 0, 1: No space left on device: "
                                    "'/run/.step-00000004.tmp/r.safetensors'")
    assert [(f.rank, f.type, f.kind) for f in err.value.failures] == [
        (0, "OSError", "OSError"), (1, "OSError", "OSError")]
    assert "Traceback" in err.value.failures[1].traceback
    with pytest.raises(RankError) as err:
        ranks(2).run(_raise, {0: ValueError("bad --tp"), 1: FloatingPointError("loss is nan")})
    assert err.value.expected
    assert err.value.one_line() == "rank 0: bad --tp; rank 1: loss is nan"


def test_a_bug_is_not_expected(ranks):
    """A RuntimeError on one rank (the other returns): not expected; the message still holds
    the rank's traceback as the text of the error."""
    with pytest.raises(RankError) as err:
        ranks(2).run(_raise, {1: RuntimeError("boom")})
    assert not err.value.expected
    assert err.value.one_line() == "rank 1: boom"
    assert "--- rank 1 failed:\nTraceback" in str(err.value) and "RuntimeError: boom" in str(
        err.value)


def test_safetensors_io_errors_become_os_errors(tmp_path):
    """safetensors says "I/O error: ... (os error 28)" in a SafetensorError: the save turns it
    into the OSError, naming the file."""
    path = tmp_path / "rank00-of01.safetensors"
    for code, text in ((errno.ENOSPC, "No space left on device"), (errno.EFBIG, "File too large")):
        e = _io_error(SafetensorError(f"Error while serializing: I/O error: {text} "
                                      f"(os error {code})"), path)
        assert isinstance(e, OSError) and e.errno == code
        assert describe(e) == f"{text}: '{path}'"
    bug = SafetensorError("tensor is not contiguous")
    assert _io_error(bug, path) is bug


def _failing_run(error: RankError):
    def run(args):
        raise error
    return run


def _rank_error(*failures: tuple[int, BaseException]) -> RankError:
    made = []
    for rank, e in failures:
        try:
            raise e
        except BaseException as raised:
            made.append(RankFailure.of(rank, raised))
    text = "\n".join(f"--- rank {f.rank} failed:\n{f.traceback}" for f in made)
    return RankError(text, made)


@pytest.mark.parametrize("debug", ["", "flag", "env"])
def test_cli_prints_one_line_or_tracebacks(monkeypatch, capsys, debug):
    """``tensorpar train`` whose ranks failed: an expected error is one line (exit 1), with
    ``--debug`` or ``TENSORPAR_DEBUG=1`` after the tracebacks; a bug prints them always."""
    expected = _rank_error((1, OSError(errno.EFBIG, "File too large", "/r/rank01.safetensors")))
    bug = _rank_error((0, KeyError("blocks.9")))
    argv = ["--debug"] * (debug == "flag") + ["train"]
    monkeypatch.setenv("TENSORPAR_DEBUG", "1" if debug == "env" else "0")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        for error, shows_traceback in ((expected, bool(debug)), (bug, True)):
            monkeypatch.setattr(cli_train, "run", _failing_run(error))
            assert cli.main(argv) == 1
            err = capsys.readouterr().err
            assert ("Traceback" in err) == shows_traceback, err
            assert err.splitlines()[-1] == f"tensorpar train: {error.one_line()}"
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert expected.one_line() == "rank 1: File too large: '/r/rank01.safetensors'"
