"""What went wrong on a rank, told apart: an expected error (one line) or a bug (its traceback).

Expected errors are the ones a user can act on without reading code: a ``ValueError`` (a request
or a checkpoint that does not fit; ``CheckpointError`` is one), an ``OSError`` (a full disk, a
file too large for ``ulimit -f``, a permission), a ``FloatingPointError`` (a training step
that went non-finite) and a :class:`CollectiveMismatch` (ranks that fed one collective different
shapes, found by the check mode of ``checking.py``). Anything else is a bug, and its traceback is
what helps.

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


class CollectiveMismatch(RuntimeError):
    """Ranks called one collective with different ops, shapes or dtypes (torch's check found it
    before any data moved). ``seen``: rank -> ``"all_reduce [3, 8, 16] float32"`` for the ranks
    this rank heard of (itself first); ``where``: the layer and pass, e.g.
    ``"blocks.0.mlp.down (forward)"``, or None when unknown."""

    def __init__(self, seen: dict[int, str], where: str | None = None):
        self.seen, self.where = dict(seen), where
        super().__init__(mismatch_line(where, self.seen))

    def __reduce__(self):  # pickled as what it is made of, not as its message
        return type(self), (self.seen, self.where)


class PeerLost(RuntimeError):
    """Under torchrun: this rank's collective failed because another rank died or stopped
    answering (torchrun's own report names that rank and how it ended)."""


EXPECTED = (ValueError, OSError, FloatingPointError, CollectiveMismatch, PeerLost)

# what gloo and NCCL say when the rank at the other end stopped answering or died (the last
# one: torch's check mode, when a rank never reaches the collective)
_LOST_PEER = ("Timed out waiting", "Connection reset by peer", "Connection closed by peer",
              "NCCL communicator was aborted", "Watchdog caught collective operation timeout",
              "failed to pass monitoredBarrier")

# torch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL), torch 2.13: "Detected mismatch
# between collectives on ranks. Rank 3 is running collective: CollectiveFingerPrint(
# SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[2, 8, 16], TensorDtypes=Float, ...), but
# Rank 0 is running collective: CollectiveFingerPrint(...)."; the first rank is the one raising
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=\d+, OpType=(\w+), TensorShape=\[([^\]]*)\], "
                          r"TensorDtypes=(\w*)")
_OPS = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather",
        "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter",
        "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all", "ALLREDUCE_COALESCED":
        "all_reduce_coalesced", "ALLGATHER_COALESCED": "all_gather_coalesced"}
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool"}


def collective_mismatch(e: BaseException, where: str | None = None) -> CollectiveMismatch | None:
    """``e`` as a :class:`CollectiveMismatch` (``where`` added when it has none), or None when it
    is not torch's mismatch error."""
    if isinstance(e, CollectiveMismatch):
        return e if e.where or not where else CollectiveMismatch(e.seen, where)
    if not isinstance(e, RuntimeError) or "Detected mismatch between collectives" not in str(e):
        return None
    seen = {}
    for rank, op, shape, dtype in _FINGERPRINT.findall(str(e)):
        seen.setdefault(int(rank), f"{_OPS.get(op, op.strip('_').lower())} [{shape}] "
                                   f"{_DTYPES.get(dtype, dtype.lower())}")
    return CollectiveMismatch(seen, where) if seen else None


def rank_list(ranks) -> str:
    """``rank 0``, ``ranks 1-3``, ``ranks 0, 2-3``."""
    ranks, runs = sorted(ranks), []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' * (len(ranks) > 1)} {text}"


def mismatch_line(where: str | None, seen: dict[int, str]) -> str:
    """``collective mismatch in WHERE: rank 0 all_reduce [3, 8] float32; ranks 1-3 ...``."""
    by_call: dict[str, list[int]] = {}
    for rank in sorted(seen):
        by_call.setdefault(seen[rank], []).append(rank)
    calls = "; ".join(f"{rank_list(r)} {call}" for call, r in by_call.items())
    return f"collective mismatch{f' in {where}' if where else ''}: {calls}"


def lost_peer(f: RankFailure) -> bool:
    """``f`` is a collective that failed because another rank stopped answering or died."""
    return f.type.startswith(("RuntimeError", "Dist")) and any(s in f.message for s in _LOST_PEER)


def peer_lost(e: BaseException, hint: str | None = None) -> PeerLost | None:
    """``e`` as a :class:`PeerLost` when it is a collective that failed for want of another rank
    (gloo's or NCCL's message, shortened), with ``hint`` last; None otherwise."""
    if not isinstance(e, RuntimeError) or not any(s in str(e) for s in _LOST_PEER):
        return None
    line = f"lost another rank ({_short(str(e))}); torchrun's report names it"
    return PeerLost(f"{line}; {hint}" if hint else line)


def collective_failure(e: BaseException,
                       hint: str | None = None) -> CollectiveMismatch | PeerLost | None:
    """``e`` as the expected error it stands for when a collective failed: ranks that disagree
    (:func:`collective_mismatch`) or a rank lost (:func:`peer_lost`, with ``hint``); else None."""
    return collective_mismatch(e) or peer_lost(e, hint)


def _short(message: str) -> str:
    """gloo's message without its source location, the peer's address and its advice: 'Timed out
    waiting 10000ms for recv operation to complete', 'Read error: Connection reset by peer'."""
    message = re.sub(r"^\[[^\]]*\]:? ", "", message)
    message = re.sub(r" \[[0-9a-fA-F.:]+\]:\d+", "", message)  # the peer's address: one line
    return message.split(". This is typically caused", 1)[0]  # for all the ranks that saw it


def expected_kind(e: BaseException) -> str | None:
    """The expected family ``e`` belongs to ("ValueError", "OSError", "FloatingPointError",
    "CollectiveMismatch", torch's own mismatch error included), or None for a bug."""
    if collective_mismatch(e) is not None:
        return CollectiveMismatch.__name__
    return next((k.__name__ for k in EXPECTED if isinstance(e, k)), None)


def describe(e: BaseException) -> str:
    """``e`` as the user should read it: an OSError with its cause and file, without the errno
    (``File too large: '/run/.step-00000004.tmp/rank01-of02.safetensors'``), torch's mismatch
    error in one line (``collective mismatch: rank 1 all_reduce [2, 8] float32; rank 0 ...``),
    else ``str(e)``."""
    if (mismatch := collective_mismatch(e)) is not None:
        return str(mismatch)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {str(e.filename)!r}" if e.filename is not None else "")
    return str(e) or type(e).__name__


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One rank's exception. ``kind``: its expected family, None for a bug; ``mismatch``: for a
    collective mismatch, (where, ((rank, call), ...)) as :class:`CollectiveMismatch` holds them,
    the failing rank's own call first."""

    rank: int
    type: str  # the exception's class name
    message: str  # describe(e)
    traceback: str
    kind: str | None
    mismatch: tuple | None = None

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RankFailure:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        m = collective_mismatch(e)
        mismatch = None if m is None else (m.where, tuple(m.seen.items()))
        return cls(rank, type(e).__name__, describe(e), tb, expected_kind(e), mismatch)

    @property
    def expected(self) -> bool:
        return self.kind is not None


class RankError(RuntimeError):
    """A function failed on one or more ranks. ``str(e)``: the pool's reason (a rank that died or
    hung), then each failing rank's traceback. ``failures``: one :class:`RankFailure` per failing
    rank, in rank order; ``why``: the pool's reason, or None; ``died``: some rank's process died
    (a crash: never expected); ``hint``: what to try next, said last in :meth:`one_line`."""

    def __init__(self, message: str, failures: list[RankFailure] | tuple = (),
                 why: str | None = None, died: bool = False, hint: str | None = None):
        super().__init__(message)
        self.failures, self.why, self.died, self.hint = list(failures), why, died, hint

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
        different messages joined by ``; ``; the pool's reason, if any, in parentheses. A
        collective mismatch on every failing rank: one ``collective mismatch`` line with each
        rank's call. The hint, if any, last."""
        line = self._line()
        return f"{line}; {self.hint}" if self.hint else line

    def _line(self) -> str:
        if self.failures and all(f.mismatch for f in self.failures):
            line = self._mismatch_line()
            return f"{line} ({self.why})" if self.why else line
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

    def _mismatch_line(self) -> str:
        """Each failing rank's own call, what the others heard for the ranks that did not fail;
        the place from the ranks that named one (several places: each with its ranks)."""
        own = {calls[0][0]: calls[0][1] for _, calls in (f.mismatch for f in self.failures)}
        heard = {r: c for _, calls in (f.mismatch for f in self.failures) for r, c in calls}
        where: dict[str, list[int]] = {}
        for f in self.failures:
            if f.mismatch[0]:
                where.setdefault(f.mismatch[0], []).append(f.rank)
        place = ", ".join(f"{w} on {rank_list(r)}" for w, r in where.items()) if len(
            where) > 1 else next(iter(where), None)
        return mismatch_line(place, heard | own)
