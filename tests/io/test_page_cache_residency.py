"""Page-cache residency (direct_io="auto" and prefetch decide with it)."""


import numpy as np

from foxhunt_stream.io import pagecache
from page_cache_support import evict


def test_resident_fraction_sampled_and_exhaustive(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes())
    p.read_bytes()
    assert pagecache.resident_fraction(p) == 1.0
    assert pagecache.resident_fraction(p, samples=1 << 62) == 1.0     # "every page": one call, not 2**62
    evict(p)
    assert pagecache.resident_fraction(p) < 0.5
    assert pagecache.resident_fraction(p, samples=1 << 62) < 0.5
