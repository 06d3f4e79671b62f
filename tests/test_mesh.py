"""ParallelContext: coordinates, group membership, counted collectives."""

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import group_members, init, rank_coords
from tests.helpers.runner import init_method, run_distributed


def test_coordinates_tp_fastest() -> None:
    sizes = {"dp": 2, "cp": 1, "pp": 2, "tp": 2}
    assert rank_coords(0, sizes) == {"dp": 0, "cp": 0, "pp": 0, "tp": 0}
    assert rank_coords(1, sizes) == {"dp": 0, "cp": 0, "pp": 0, "tp": 1}
    assert rank_coords(2, sizes) == {"dp": 0, "cp": 0, "pp": 1, "tp": 0}
    assert rank_coords(7, sizes) == {"dp": 1, "cp": 0, "pp": 1, "tp": 1}
    assert group_members(("tp",), sizes) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert group_members(("dp",), sizes) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert group_members(("pp", "tp"), sizes) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_layout_must_equal_world() -> None:
    with pytest.raises(UserError, match="does not equal the world size 4"):
        ParallelConfig(dp=3).resolve_dp(4)
    assert ParallelConfig(tp=2).resolve_dp(8) == 4


def _all_reduce_worker() -> dict:
    ctx = init(ParallelConfig(dp=2, tp=2), init_method=init_method())
    t = torch.full((1000,), float(ctx.rank))
    ctx.comm.all_reduce(t, ctx.group("dp"))
    tp = torch.full((10,), float(ctx.rank))
    ctx.comm.all_reduce(tp, ctx.group("tp"))
    return {
        "dp": t[0].item(), "tp": tp[0].item(), "coords": ctx.coords,
        "stats": ctx.comm.stats.snapshot(), "dp_ranks": ctx.group("dp").ranks,
    }


def test_groups_and_counts_on_four_ranks() -> None:
    out = run_distributed(_all_reduce_worker, 4)
    # dp groups are {0, 2} and {1, 3}; tp groups {0, 1} and {2, 3}.
    assert [o["dp"] for o in out] == [2.0, 4.0, 2.0, 4.0]
    assert [o["tp"] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert out[3]["dp_ranks"] == (1, 3)
    stats = out[0]["stats"]
    assert stats["all_reduce/dp"] == {"calls": 1, "payload_bytes": 4000, "wire_bytes": 4000}
    assert stats["all_reduce/tp"] == {"calls": 1, "payload_bytes": 40, "wire_bytes": 40}


def test_backend_choice() -> None:
    from ndtrain.dist.mesh import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "gloo"
    with pytest.raises(UserError, match="'nccl' needs CUDA devices"):
        resolve_backend("nccl", cpu)
    if not torch.distributed.is_mpi_available():
        with pytest.raises(UserError, match="this torch build has no MPI support"):
            resolve_backend("mpi", cpu)
