"""``import foxhunt_stream`` stays light: no numpy, torch or cupy until a name that needs them is
used, and every public name still resolves (lazily) to the right object."""

from __future__ import annotations

import os
import subprocess
import sys

import foxhunt_stream as fs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_loads_no_heavy_module():
    out = _run("import sys, foxhunt_stream as fs; "
               "print(sorted(m for m in ('numpy', 'torch', 'cupy', 'ml_dtypes', 'foxhunt_stream.engine.loader') "
               "if m in sys.modules))")
    assert out == "[]"


def test_every_public_name_resolves():
    for name in fs.__all__:
        value = getattr(fs, name)
        assert value is not None, name
    assert callable(fs.prefetch) and callable(fs.load_file) and fs.settings.merge   # functions, not modules
    from foxhunt_stream.api import load_file
    assert fs.load_file is load_file
    assert set(fs.__all__) <= set(dir(fs))


def test_prefetch_stays_the_function_after_the_loader_imports_its_module():
    out = _run("import foxhunt_stream as fs; import foxhunt_stream.engine.loader; print(callable(fs.prefetch), "
               "type(fs.prefetch).__name__)")
    assert out == "True function"


def test_unknown_attribute_is_an_attribute_error():
    import pytest
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fs.nope


def test_a_load_imports_neither_prefetch_nor_checksum_nor_save_nor_shard_code():
    """A plain load's first call pays only for the load path: the startup machinery (prefetch,
    its readers and helper process, code files, import traces), checksums, the saver, the
    tensor-parallel slicing (``format.tp``), the member-by-member header reader, the words of
    device errors (``cuda.diagnose``) and the JSON scanner's patterns are for those who use them."""
    out = _run("import json, os, struct, sys, tempfile\n"
               "import numpy as np, foxhunt_stream as fs\n"
               "p = os.path.join(tempfile.mkdtemp(), 'a.safetensors')\n"
               "h = json.dumps({'x': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}}).encode()\n"
               "open(p, 'wb').write(struct.pack('<Q', len(h)) + h + np.arange(2, dtype=np.float32).tobytes())\n"
               "assert fs.load_file(p)['x'].tolist() == [0.0, 1.0]\n"
               "print(sorted(m for m in ('foxhunt_stream.startup.prefetch', 'foxhunt_stream.startup.code_files',"
               " 'foxhunt_stream.startup.readers', 'foxhunt_stream.startup.helper_process',"
               " 'foxhunt_stream.startup.importtrace', 'foxhunt_stream.integrity.verifier', 'foxhunt_stream.integrity.checksums',"
               " 'foxhunt_stream.engine.saver', 'foxhunt_stream.format.tp', 'foxhunt_stream.format.header_json',"
               " 'foxhunt_stream.cuda.diagnose') if m in sys.modules))\n"
               "from foxhunt_stream.format import json_scan\n"
               "print(json_scan._compiled.cache_info().currsize)")
    assert out == "[]\n0"
