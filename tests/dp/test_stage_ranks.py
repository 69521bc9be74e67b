"""``mesh/experts.py``'s ``stage_ranks``: a stage's ranks, the ones ``--ep`` folds its groups
from, in (dp, tp) row-major order, found by the mesh's dim names whatever dims it has. A mesh
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
    # a "cp" dim between dp and tp: each CP index is a stage of its own dp x tp ranks
    (("dp", "cp", "tp"), (2, 2, 2), [[0, 1, 4, 5], [2, 3, 6, 7]]),
    (("pp", "dp", "cp", "tp"), (2, 1, 2, 2), [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_stages_by_dim_names(names, sizes, stages):
    """Every dim other than "dp" and "tp" indexes stages; within one, dp outer and tp inner."""
    assert stage_ranks(_mesh(names, sizes), None) == stages
