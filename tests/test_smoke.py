import numpy as np
import safetensors.numpy as stn

import foxhunt_stream as fs


def test_roundtrip_matches_reference(tmp_path):
    t = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int16)}
    fs.save_file(t, tmp_path / "x.safetensors", metadata={"k": "v"})
    stn.save_file(t, str(tmp_path / "y.safetensors"), metadata={"k": "v"})
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()
    out = fs.load_file(tmp_path / "x.safetensors")
    for k in t:
        np.testing.assert_array_equal(out[k], t[k])
