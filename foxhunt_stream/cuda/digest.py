"""xxh3-64 checksum block digests on the GPU, where the bytes already are: on the host, hashing is
one more read of every byte (``verify=True``: +1-5% of a hot load on the GPU, +33-47% on the host;
docs/architecture.md). XXH3-64 (seed 0, default secret) of blocks over 240 bytes, a CUDA kernel
(``spans_digests``) written from the specification and checked against python-xxhash.
"""

from __future__ import annotations

import threading

import numpy as np

SECRET = bytes((
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
))
STRIPE = 64          # bytes per stripe: 8 lanes of 8 bytes
MIN_LONG = 241       # shorter inputs take the short-input paths (host only)


def _secret_words(offset: int) -> np.ndarray:
    """The 8 little-endian 64-bit words of the secret starting at byte ``offset`` (any offset)."""
    return np.frombuffer(SECRET[offset:offset + 64], "<u8").astype(np.uint64)


# ---------------------------------------------------------------- the CUDA kernel

def kernel_keys() -> np.ndarray:
    """The 40 secret words the kernel uses: 24 at byte offsets 8k (stripes and scramble),
    8 at 121 + 8j (the last stripe), 8 at 11 + 8j (the merge): unaligned ones precomputed here."""
    aligned = np.frombuffer(SECRET, "<u8")[:24]
    return np.concatenate([aligned, _secret_words(len(SECRET) - STRIPE - 7), _secret_words(11)]).astype(np.uint64)


# One warp per checksum block: XXH3 is sequential from one 1 KiB block to the next, but lane t
# owns accumulator t % 8 and loads words t, t + 32, t + 64, t + 96 of each (one coalesced load),
# the four lanes of an accumulator adding their parts with two shuffles (a thread per block: ~11 GB/s).
KERNEL = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u64 load_le(const unsigned char* p) {
    u64 v = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) v |= (u64)p[i] << (8 * i);
    return v;
}

__device__ __forceinline__ u64 mix32(u64 v, u64 k) {   // lo32(v ^ k) * hi32(v ^ k)
    const u64 dk = v ^ k;
    return (u64)(u32)dk * (dk >> 32);
}

// the lane's accumulator += the products of its lane over the warp + the words of lane ^ 1
__device__ __forceinline__ u64 gather(u64 acc, u64 prod, u64 words) {
    prod += __shfl_xor_sync(0xffffffffu, prod, 8);
    prod += __shfl_xor_sync(0xffffffffu, prod, 16);
    words += __shfl_xor_sync(0xffffffffu, words, 8);
    words += __shfl_xor_sync(0xffffffffu, words, 16);
    return acc + prod + __shfl_xor_sync(0xffffffffu, words, 1);
}

// table: count device addresses (8-byte aligned), then count lengths: the blocks to hash, of any
// tensors; keys: kernel_keys() (40 words); 32 x W threads per CTA, warp w of CTA c hashing
// block c * W + w. out[b] = XXH3-64 of block b, or 0 if it is shorter than 241 bytes.
extern "C" __global__ void xxh3_blocks(const u64* __restrict__ table, u64 count,
                                       const u64* __restrict__ keys, u64* __restrict__ out) {
    const u64 b = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= count) return;                       // the whole warp leaves together
    const int t = threadIdx.x & 31, lane = t & 7, q = t >> 3;
    const unsigned char* data = (const unsigned char*)table[b];
    const u64 len = table[count + b];
    if (len < 241) { if (t == 0) out[b] = 0; return; }
    const u64* __restrict__ w = (const u64*)data;
    const u64 init[8] = {0xC2B2AE3DULL, 0x9E3779B185EBCA87ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                         0x85EBCA77C2B2AE63ULL, 0x85EBCA77ULL, 0x27D4EB2F165667C5ULL, 0x9E3779B1ULL};
    u64 acc = init[lane];
    // word t + 32k of a 1 KiB block is lane `lane` of stripe q + 4k, keyed by secret word q + 4k + lane
    u64 key[4];
    #pragma unroll
    for (int k = 0; k < 4; ++k) key[k] = keys[q + 4 * k + lane];
    const u64 scramble = keys[16 + lane];
    const u64 n_blocks = (len - 1) / 1024;
    // 1 KiB blocks four at a time, the next four's loads issued before this four's chain runs
    // (the chain is sequential: without loads in flight it waits on memory every step)
    const u64 n_quads = n_blocks / 4;
    u64 cur[4][4];
    #pragma unroll
    for (int j = 0; j < 4; ++j)
        #pragma unroll
        for (int k = 0; k < 4; ++k) cur[j][k] = n_quads ? w[j * 128 + t + 32 * k] : 0;
    for (u64 g = 0; g < n_quads; ++g) {
        const u64 nb = (g + 1 < n_quads ? g + 1 : g) * 4;   // the last quad reloads itself: in bounds
        u64 nxt[4][4];
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int k = 0; k < 4; ++k) nxt[j][k] = w[(nb + j) * 128 + t + 32 * k];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            u64 prod = 0, words = 0;
            #pragma unroll
            for (int k = 0; k < 4; ++k) { prod += mix32(cur[j][k], key[k]); words += cur[j][k]; }
            acc = gather(acc, prod, words);
            acc ^= acc >> 47;
            acc ^= scramble;
            acc *= 0x9E3779B1ULL;
        }
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int k = 0; k < 4; ++k) cur[j][k] = nxt[j][k];
    }
    u64 bl = n_quads * 4;
    for (; bl < n_blocks; ++bl) {
        u64 prod = 0, words = 0;
        #pragma unroll
        for (int k = 0; k < 4; ++k) { const u64 v = w[bl * 128 + t + 32 * k]; prod += mix32(v, key[k]); words += v; }
        acc = gather(acc, prod, words);
        acc ^= acc >> 47;
        acc ^= scramble;
        acc *= 0x9E3779B1ULL;
    }
    {   // the stripes of the last, partial 1 KiB block
        const u64 rest = ((len - 1) - n_blocks * 1024) / 64;
        u64 prod = 0, words = 0;
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            if ((u64)(q + 4 * k) < rest) { const u64 v = w[n_blocks * 128 + t + 32 * k]; prod += mix32(v, key[k]); words += v; }
        }
        acc = gather(acc, prod, words);
    }
    {   // the input's last 64 bytes (maybe unaligned), keyed from secret byte 121
        u64 prod = 0, words = 0;
        if (q == 0) { const u64 v = load_le(data + len - 64 + 8 * lane); prod = mix32(v, keys[24 + lane]); words = v; }
        acc = gather(acc, prod, words);
    }
    u64 a[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = __shfl_sync(0xffffffffu, acc, j);
    if (t != 0) return;
    u64 h = len * 0x9E3779B185EBCA87ULL;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u64 x = a[2 * i] ^ keys[32 + 2 * i], y = a[2 * i + 1] ^ keys[33 + 2 * i];
        h += (x * y) ^ __umul64hi(x, y);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    h ^= h >> 32;
    out[b] = h;
}
"""
WARPS_PER_CTA = 4

_kernels: dict[int, tuple] = {}
_kernels_lock = threading.Lock()


class KernelUnavailable(RuntimeError):
    """The digest kernel cannot be built here (no NVRTC in this cupy install, an unsupported
    GPU...): the caller hashes on the host instead."""


def build_kernel(device: int):
    """The compiled kernel and its keys on ``device``, built once per process and device (NVRTC);
    a failed build is remembered and raised as KernelUnavailable on every call."""
    import cupy as cp
    k = _kernels.get(device)
    if k is None:
        with _kernels_lock:
            k = _kernels.get(device)
            if k is None:
                try:
                    with cp.cuda.Device(device):
                        keys = cp.asarray(kernel_keys())
                        # the upload went on the caller's current stream (a non-blocking one inside
                        # `with stream:`), not necessarily the null stream; kernels on other streams use it
                        cp.cuda.get_current_stream().synchronize()
                        kern = cp.RawKernel(KERNEL, "xxh3_blocks")
                        kern.compile()
                        k = (kern, keys)
                except Exception as e:  # noqa: BLE001 - NVRTC missing or failing: hash on the host
                    k = KernelUnavailable(f"the xxh3-64 digest kernel could not be built on cuda:{device}: "
                                          f"{type(e).__name__}: {e}")
                _kernels[device] = k
    if isinstance(k, KernelUnavailable):
        raise k
    return k


def device_view(ptr: int, nbytes: int, device: int):
    """A cupy uint8 array over ``nbytes`` of device memory at ``ptr`` (not owned, not copied)."""
    import cupy as cp
    mem = cp.cuda.UnownedMemory(ptr, nbytes, None, device)
    return cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))


def block_table(spans, block: int) -> tuple[np.ndarray, list[int]]:
    """Pure: the kernel's table for ``spans`` [(device address, nbytes)] cut into ``block``-byte
    blocks (addresses, then lengths, uint64) and where each span's digests start in the output."""
    if block <= 0 or block % 8:
        raise ValueError("block_digests needs a block size that is a positive multiple of 8")
    starts, lens, first = [], [], []
    n = 0
    for ptr, nbytes in spans:
        if ptr % 8:
            raise ValueError("block_digests needs 8-byte aligned addresses")
        first.append(n)
        offs = np.arange(0, nbytes, block, dtype=np.uint64)
        starts.append(offs + np.uint64(ptr))
        lens.append(np.minimum(np.uint64(block), np.uint64(nbytes) - offs))
        n += len(offs)
    first.append(n)
    if not starts:
        return np.zeros(0, np.uint64), first
    return np.concatenate(starts + lens), first


def spans_digests(spans, block: int, device: int = 0, stream=None):
    """XXH3-64 of each ``block``-byte block of every span [(device address, nbytes)] on
    ``device``, in one launch: a cupy uint64 array and each span's first index into it (plus the
    total at the end). Blocks shorter than 241 bytes give 0 (hash them on the host). Queued on
    ``stream`` (cupy's current stream if None); nothing is synchronized."""
    import contextlib

    import cupy as cp
    table, first = block_table(spans, block)
    count = first[-1]
    kern, keys = build_kernel(device)
    with cp.cuda.Device(device), (stream if stream is not None else contextlib.nullcontext()):
        out = cp.empty(count, cp.uint64)
        if count:
            dev_table = cp.asarray(table)   # queued on the stream, ahead of the kernel
            kern((-(-count // WARPS_PER_CTA),), (32 * WARPS_PER_CTA,), (dev_table, cp.uint64(count), keys, out))
    return out, first


def block_digests(ptr: int, nbytes: int, block: int, device: int = 0, stream=None):
    """XXH3-64 of each ``block``-byte block of the ``nbytes`` at device address ``ptr`` (on
    ``device``), as a cupy uint64 array (see spans_digests)."""
    return spans_digests([(ptr, nbytes)], block, device, stream)[0]
