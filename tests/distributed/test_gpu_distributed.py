"""Distributed loads over NCCL on two GPUs (world size 2, device cuda:RANK): the same scenarios
and checks as the gloo run of test_distributed.py (results equal a single-process load, the
group reads the checkpoint once, an error on one rank raises on both, no hang).

Skips cleanly without torch, cupy, NCCL or two CUDA devices.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
import torch.distributed as dist  # noqa: E402

from foxhunt_stream.cuda import devices as fs_device  # noqa: E402

if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and fs_device.cuda_available()):
    pytest.skip("needs two CUDA GPUs visible to torch and cupy", allow_module_level=True)
if not (dist.is_available() and dist.is_nccl_available()):
    pytest.skip("torch.distributed with NCCL is not available", allow_module_level=True)

from dist_harness import check_reports, collect, start_world  # noqa: E402

pytestmark = pytest.mark.gpu


def test_nccl_two_gpus_match_single_process(tmp_path):
    [(world, reports, total)] = collect([start_world(tmp_path, 2, backend="nccl", device="cuda:{rank}")],
                                        timeout=300)
    check_reports(reports, world, total, ckpt=str(tmp_path / f"world{world}" / "ckpt"))
