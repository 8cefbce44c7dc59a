"""The single-GPU load time the two-GPU results are compared with: 4 loads of CKPT to cuda:0 in
one process, the best of the last 3.

    python3 benchmarks/single_load.py /dev/shm/tpb
"""

import sys
import time

import torch

import foxhunt_stream as fs


def main(ckpt: str) -> int:
    ts = []
    for _ in range(4):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fs.load_file(ckpt, device="cuda:0", framework="pt")
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
        n = sum(v.numel() * v.element_size() for v in out.values())
        del out
    print(f"single-GPU load, one process, cuda:0: {n / 1e9:.3f} GB, runs {[round(x, 3) for x in ts]}, "
          f"best of last 3 {min(ts[1:]):.3f} s = {n / min(ts[1:]) / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
