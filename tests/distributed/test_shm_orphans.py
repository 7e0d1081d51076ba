"""A weight-sync buffer whose owner process exited without removing it is found and removed."""

import os
import subprocess
import sys

import torch

from cwgrpo_megatron.weight_sync import shm


def test_buffers_of_dead_owners_are_removed(tmp_path):
    # a buffer created by a process that then exited without cleaning up
    code = (
        "import torch; from cwgrpo_megatron.weight_sync import shm; "
        f"shm.create({{'w': (4, 4)}}, torch.float32, folder={str(tmp_path)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    mine = shm.create({"w": (4, 4)}, torch.float32, folder=str(tmp_path))
    try:
        assert len(list(tmp_path.glob("cwgrpo-buffer-*"))) == 2
        assert shm.remove_orphaned_buffers(str(tmp_path)) == 1
        assert [p.name for p in tmp_path.glob("cwgrpo-buffer-*")] == [
            os.path.basename(os.path.dirname(mine.path))
        ]
    finally:
        shm.remove(mine)
    assert list(tmp_path.iterdir()) == []
