"""The one spawn helper: a pool of real gloo ranks per world size, kept for the whole session.

Test bodies are module-level functions (picklable) that run on every rank; ``ranks(n).run(fn, ...)``
returns their per-rank results or raises ``RankError`` with the failing rank's traceback. A pool
that had to be stopped (a rank stuck or dead) is replaced by a fresh one for the next test.

The pools check every collective across ranks (``runtime/checking.py``): a test whose ranks feed
a collective different shapes fails with one line naming them instead of gloo aborting the pool.
It costs little here (tests/core: 136 s without, 141 s with; the time goes to Python, not to
the collectives), and the collective counts are the same (the check runs below the dispatcher).
"""

import pytest

from tensorpar.runtime.launch import RankPool

from tests_common import WORLD_SIZES  # noqa: F401


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools or pools[n]._closed:
            pools[n] = RankPool(n, backend="gloo", threads=1, timeout_s=240, grace_s=5,
                                check_collectives=True)
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()
