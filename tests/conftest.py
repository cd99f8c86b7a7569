import os
import socket
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def group() -> Iterator[dist.ProcessGroup]:
    """A process group of one process (gloo), for the in-process tests that need one."""
    if dist.is_initialized():  # left by an in-process Trainer of an earlier test (Lightning keeps it): one process
        assert dist.get_world_size() == 1
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
