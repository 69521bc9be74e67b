"""The one spawn helper: a pool of real gloo ranks per world size, kept for the whole session.

Test bodies are module-level functions (picklable) that run on every rank; ``ranks(n).run(fn, ...)``
returns their per-rank results or raises ``RankError`` with the failing rank's traceback. A pool
that had to be stopped (a rank stuck or dead) is replaced by a fresh one for the next test.
"""

import pytest

from tensorpar.runtime.launch import RankPool

from tests_common import WORLD_SIZES  # noqa: F401


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools or pools[n]._closed:
            pools[n] = RankPool(n, backend="gloo", threads=1, timeout_s=240, grace_s=5)
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()
