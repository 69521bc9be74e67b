"""The one spawn helper: a pool of real gloo ranks per world size, kept for the whole session.

Test bodies are module-level functions (picklable) that run on every rank; ``ranks(n).run(fn, ...)``
returns their per-rank results or raises ``RankError`` with the failing rank's traceback. A pool
that had to be stopped (a rank stuck or dead) is replaced by a fresh one for the next test.

The pools check every collective across ranks (``launch/checking.py``): a test whose ranks feed
a collective different shapes fails with one line naming them instead of gloo aborting the pool.
The collective counts are the same (the check runs below the dispatcher that counts them). The
check costs about 3 ms per collective, a quarter to a third more time for tests that run many
steps, but the whole suite took 540 s checked against 550 s with only tests/core checked
(2026-11-26, fresh clones, the same machine). ``TENSORPAR_CHECK_COLLECTIVES=0`` runs every pool
unchecked, ``=core`` only the layer tests' (tests/core). Commands the tests start as processes
run as a user's would: unchecked, unless the test asks for the check.
"""

import os
import signal

import pytest

from tensorpar.ranks.forkserver import COMMAND_MODULES, HF_MODULES, start_server
from tensorpar.ranks.local import RankPool
from tensorpar.runtime.groups import CHECK_ENV

from tests_common import WORLD_SIZES  # noqa: F401

# A suite started in the background of a non-interactive shell (`make test &`) inherits SIGINT
# ignored, and every command it starts would too (an ignored signal stays ignored through exec):
# the Ctrl-C tests' SIGINT would then reach no one. Ctrl-C as a terminal gives it, for all.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every rank this session forks, the pools' and those of commands run in this process
# (tests_common.tensorpar_here), comes from one fork server that imports, once, what the
# commands' ranks import (torch._dynamo and matplotlib: 3 s a rank otherwise; transformers' model
# code for --hf: 4 s). With transformers in every rank a MemoryMeter's scan of the live objects
# at entry takes 0.42 s instead of 0.33.
start_server(sorted({module for modules in COMMAND_MODULES.values() for module in modules}
                    | set(HF_MODULES)))


@pytest.fixture(scope="session")
def _pools():
    pools: dict[tuple[int, bool], RankPool] = {}

    def get(n: int, checked: bool) -> RankPool:
        if (n, checked) not in pools or pools[n, checked]._closed:
            pools[n, checked] = RankPool(n, backend="gloo", threads=1, timeout_s=240, grace_s=5,
                                         check_collectives=checked)
        return pools[n, checked]

    yield get
    for pool in pools.values():  # side by side: each rank takes a second or two to shut down
        pool.ask_to_stop()
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def ranks(_pools, request):
    """``ranks(n)``: the session's pool of n ranks, checking its collectives
    (TENSORPAR_CHECK_COLLECTIVES=0: none; =core: only for the layer tests, tests/core)."""
    mode = os.environ.get(CHECK_ENV, "1")
    checked = request.node.path.parent.name == "core" if mode == "core" else mode != "0"
    return lambda n: _pools(n, checked)
