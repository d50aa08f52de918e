"""Running the same training under torchrun: process groups, ranks and threads."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .runtime import course_threads

__all__ = ["DistributedContext", "setup_distributed", "teardown_distributed"]


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _threads_per_process(local_world_size: int) -> int:
    """Split the cores between the processes on this machine (COURSE_THREADS overrides)."""
    wanted = course_threads()
    if wanted is not None:
        return wanted
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def setup_distributed(device_type: str = "cpu") -> DistributedContext:
    """Join the process group torchrun described in the environment; a no-op without torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        if os.environ.get("COURSE_THREADS") and device_type == "cpu":
            torch.set_num_threads(_threads_per_process(1))
        return DistributedContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        # gloo runs on any CPU; NCCL is the fast path between NVIDIA GPUs.
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        # torchrun sets OMP_NUM_THREADS=1 unless told otherwise, leaving cores idle.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        torch.set_num_threads(_threads_per_process(local_world))
    return DistributedContext(rank, local_rank, world_size)


def teardown_distributed(wait_for_all: bool = True) -> None:
    """Leave the process group (a no-op without one).

    ``wait_for_all``: first wait until every rank is here, so no rank exits while another
    (rank 0 evaluating and saving, say) still holds the group's connections open.
    """
    if not isinstance(wait_for_all, bool):
        raise TypeError(f"wait_for_all: expected True or False, got {type(wait_for_all).__name__}")
    if dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()
