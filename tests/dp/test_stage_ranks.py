"""``mesh/experts.py``'s ``stage_ranks``: a stage's ranks, the ones ``--ep`` folds its groups
from, in (dp, cp, tp) row-major order, found by the mesh's dim names whatever dims it has. A mesh
here is its rank grid and names (what ``stage_ranks`` reads of a ``DeviceMesh``)."""

from types import SimpleNamespace

import pytest
import torch

from tensorpar.mesh.experts import stage_ranks


def _mesh(names: tuple[str, ...], sizes: tuple[int, ...]):
    return SimpleNamespace(mesh=torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes),
                           mesh_dim_names=names)


@pytest.mark.parametrize("names, sizes, stages", [
    (("dp", "tp"), (2, 2), [[0, 1, 2, 3]]),
    (("pp", "dp", "tp"), (2, 2, 2), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    # a "cp" dim between dp and tp: the CP ranks hold other tokens, as the dp ranks do, and
    # are in the stage with them
    (("dp", "cp", "tp"), (2, 2, 2), [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (("pp", "dp", "cp", "tp"), (2, 1, 2, 2), [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_stages_by_dim_names(names, sizes, stages):
    """"pp" indexes stages; within one, dp outer, then cp, tp inner."""
    assert stage_ranks(_mesh(names, sizes), None) == stages
