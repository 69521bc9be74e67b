"""What went wrong on a rank, told apart: an expected error (one line) or a bug (its traceback).

Expected errors are the ones a user can act on without reading code: a ``ValueError`` (a request
or a checkpoint that does not fit; ``CheckpointError`` is one), an ``OSError`` (a full disk, a
file too large for ``ulimit -f``, a permission) and a ``FloatingPointError`` (a training step
that went non-finite). Anything else is a bug, and its traceback is what helps.

A rank's failure comes back to the launcher as a :class:`RankFailure` (picklable, no exception
object); :class:`RankError` holds one per failing rank, so callers never parse traceback text::

    except RankError as e:
        if e.expected:
            print(e.one_line())   # "rank 1: No space left on device: '.../rank01-of02.safetensors'"
        else:
            print(e)              # every failing rank's traceback
"""

from __future__ import annotations

import dataclasses
import re
import traceback

EXPECTED = (ValueError, OSError, FloatingPointError)

# what gloo and NCCL say when the rank at the other end stopped answering or died
_LOST_PEER = ("Timed out waiting", "Connection reset by peer", "Connection closed by peer",
              "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def lost_peer(f: RankFailure) -> bool:
    """``f`` is a collective that failed because another rank stopped answering or died."""
    return f.type.startswith(("RuntimeError", "Dist")) and any(s in f.message for s in _LOST_PEER)


def _short(message: str) -> str:
    """gloo's message without its source location and its advice: 'Timed out waiting 10000ms
    for recv operation to complete'."""
    message = re.sub(r"^\[[^\]]*\] ", "", message)
    return message.split(". This is typically caused", 1)[0]


def expected_kind(e: BaseException) -> str | None:
    """The expected family ``e`` belongs to ("ValueError", "OSError", "FloatingPointError"), or
    None for a bug."""
    return next((k.__name__ for k in EXPECTED if isinstance(e, k)), None)


def describe(e: BaseException) -> str:
    """``e`` as the user should read it: an OSError with its cause and file, without the errno
    (``File too large: '/run/.step-00000004.tmp/rank01-of02.safetensors'``), else ``str(e)``."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {str(e.filename)!r}" if e.filename is not None else "")
    return str(e) or type(e).__name__


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One rank's exception. ``kind``: its expected family, None for a bug."""

    rank: int
    type: str  # the exception's class name
    message: str  # describe(e)
    traceback: str
    kind: str | None

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RankFailure:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return cls(rank, type(e).__name__, describe(e), tb, expected_kind(e))

    @property
    def expected(self) -> bool:
        return self.kind is not None


class RankError(RuntimeError):
    """A function failed on one or more ranks. ``str(e)``: the pool's reason (a rank that died or
    hung), then each failing rank's traceback. ``failures``: one :class:`RankFailure` per failing
    rank, in rank order; ``why``: the pool's reason, or None; ``died``: some rank's process died
    (a crash: never expected)."""

    def __init__(self, message: str, failures: list[RankFailure] | tuple = (),
                 why: str | None = None, died: bool = False):
        super().__init__(message)
        self.failures, self.why, self.died = list(failures), why, died

    @property
    def lost_rank(self) -> bool:
        """A rank died or stopped answering (``why`` says which), and every failure is another
        rank's collective that lost it: expected (a killed or stopped process), not a bug."""
        return self.why is not None and all(lost_peer(f) for f in self.failures)

    @property
    def expected(self) -> bool:
        """Every failing rank failed with an expected error and no rank died, or a rank was lost
        (:attr:`lost_rank`). Ranks the pool stopped while they waited for a failed one do not
        count: they only waited."""
        if self.lost_rank:
            return True
        return bool(self.failures) and not self.died and all(f.expected for f in self.failures)

    def one_line(self) -> str:
        """``rank 1: MESSAGE``; ranks with the same message together (``ranks 0, 1: MESSAGE``);
        different messages joined by ``; ``; the pool's reason, if any, in parentheses."""
        if self.lost_rank:  # the lost rank first, then what the others' collectives said
            said = sorted({_short(f.message) for f in self.failures})
            return self.why + (f"; the other ranks' collectives: {'; '.join(said)}" if said
                               else "")
        by_message: dict[str, list[int]] = {}
        for f in self.failures:
            by_message.setdefault(f.message, []).append(f.rank)
        parts = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}"
                 for m, r in by_message.items()]
        line = "; ".join(parts) or (self.why or "failed")
        return f"{line} ({self.why})" if parts and self.why else line
