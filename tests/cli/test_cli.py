"""The command line, driven in a subprocess as a user would (CPU paths only).

Checks are made against plain JSON parsing of the files, safetensors' own serializer and the
library's documented API, not against the CLI's own helpers.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.cli import main as cli
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.engine.progress import progress_bar
from foxhunt_stream.engine.saver import RawTensor

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FOXHUNT_THREADS", None)
    return subprocess.run([sys.executable, "-m", "foxhunt_stream", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def raw_header(path) -> dict:
    """The header of a file, parsed with nothing but struct and json."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def tensor_bytes(path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes) for every tensor of one file, read by hand."""
    hdr = raw_header(path)
    data = Path(path).read_bytes()
    start = 8 + struct.unpack("<Q", data[:8])[0]
    return {k: (v["dtype"], v["shape"], data[start + v["data_offsets"][0]:start + v["data_offsets"][1]])
            for k, v in hdr.items() if k != "__metadata__"}


def all_tensor_bytes(directory) -> dict[str, tuple[str, list[int], bytes]]:
    out = {}
    for p in sorted(Path(directory).glob("*.safetensors")):
        out.update(tensor_bytes(p))
    return out


@pytest.fixture
def tensors():
    rng = np.random.default_rng(1)
    return {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layers.0.w": rng.integers(-100, 100, (32, 32), dtype=np.int16),
        "layers.0.b": rng.standard_normal(32).astype(np.float16),
        "layers.1.w": rng.standard_normal((16, 32)).astype(np.float64),
        "flag": np.array([True, False, True]),
        "scalar": np.array(3, np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


@pytest.fixture
def ckpt(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    fs.save_file(tensors, path, metadata={"format": "pt", "note": "ünïcode"})
    return path


@pytest.fixture
def sharded(tmp_path, tensors):
    d = tmp_path / "sharded"
    d.mkdir()
    fs.save_file(tensors, d, metadata={"format": "pt"}, max_shard_size="9kB")
    assert (d / "model.safetensors.index.json").exists()
    return d


# ---------------------------------------------------------------- help, usage, exit codes

def main_inproc(capsys, *args: str) -> tuple[int, str, str]:
    """cli.main in this process (argparse's exits included): for the many cheap parser cases."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_top_level_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for command in ("inspect", "verify", "bench", "reshard"):
        assert command in r.stdout


@pytest.mark.parametrize("command", ["inspect", "verify", "bench", "reshard"])
def test_help_for_every_command(capsys, command):
    code, out, _ = main_inproc(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: foxhunt-stream {command}")


def test_usage_error_exits_2():
    r = run("reshard", "a", "b", "--max-shard-size", "5 parsecs")
    assert r.returncode == 2
    assert "usage:" in r.stderr and "not a size: '5 parsecs'" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("args", [(), ("frobnicate",), ("inspect",), ("reshard", "a", "b"),
                                  ("bench", "--reps", "0"), ("bench", "--size", "-1"),
                                  ("inspect", "x", "--no-such-option")])
def test_usage_errors(capsys, args):
    code, out, err = main_inproc(capsys, *args)
    assert code == 2
    assert "usage:" in err and out == ""


# ---------------------------------------------------------------- inspect

def test_inspect_table(ckpt, tensors):
    r = run("inspect", str(ckpt))
    assert r.returncode == 0, r.stderr
    for name in tensors:
        assert name in r.stdout
    assert "[64, 32]" in r.stdout and "F32" in r.stdout and "8,192" in r.stdout
    total = sum(a.nbytes for a in tensors.values())
    assert f"total: {len(tensors)} tensors" in r.stdout and f"({total:,} bytes)" in r.stdout
    assert "ünïcode" in r.stdout
    assert "valid: yes" in r.stdout


def test_inspect_json_matches_the_library(sharded, tensors):
    r = run("inspect", str(sharded), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["valid"] is True and info["kind"] == "index"
    assert info["total_tensors"] == len(tensors)
    assert info["total_bytes"] == sum(a.nbytes for a in tensors.values())
    with fs.safe_open(sharded) as f:
        assert sorted(t["name"] for t in info["tensors"]) == f.keys()
        assert info["metadata"] == f.metadata()
        for t in info["tensors"]:
            s = f.get_slice(t["name"])
            assert t["shape"] == s.get_shape() and t["dtype"] == s.get_dtype()
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    for t in info["tensors"]:
        assert t["file"] == weight_map[t["name"]]
        entry = raw_header(sharded / t["file"])[t["name"]]
        assert t["data_offsets"] == entry["data_offsets"]
        assert t["bytes"] == entry["data_offsets"][1] - entry["data_offsets"][0]
    assert sorted(os.path.basename(f["path"]) for f in info["files"]) == sorted(set(weight_map.values()))
    assert sum(f["tensors"] for f in info["files"]) == len(tensors)
    for f in info["files"]:
        assert f["size"] == os.path.getsize(f["path"])


def test_inspect_a_100k_tensor_header(tmp_path):
    n = 100_000
    body = ",".join(f'"model.layers.{i // 10}.w{i % 10}":{{"dtype":"F16","shape":[2],"data_offsets":[{4 * i},{4 * i + 4}]}}'
                    for i in range(n))
    body = ("{" + body + "}").encode()
    path = tmp_path / "many.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
        f.truncate(8 + len(body) + 4 * n)
    r = run("inspect", str(path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["total_tensors"] == n == len(info["tensors"])
    assert info["total_bytes"] == 4 * n
    assert info["tensors"][-1] == {"name": "model.layers.9999.w9", "dtype": "F16", "shape": [2], "bytes": 4,
                                   "file": "many.safetensors", "data_offsets": [4 * n - 4, 4 * n]}


def test_inspect_invalid_file_one_line_error(ckpt):
    with open(ckpt, "r+b") as f:
        f.truncate(os.path.getsize(ckpt) - 3)
    r = run("inspect", str(ckpt))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(ckpt) in lines[0] and "[incomplete-buffer]" in lines[0]
    assert "Traceback" not in r.stderr
    r = run("inspect", str(ckpt), "--json")
    assert r.returncode == 1
    err = json.loads(r.stdout)
    assert err["valid"] is False and err["error"]["rule"] == "incomplete-buffer"
    assert err["error"]["path"] == str(ckpt)


def _hand_written(path, shape, dtype="U8", data=b""):
    """One tensor ``t`` of ``shape``, header and data written by hand (shapes our saver refuses)."""
    body = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


@pytest.mark.parametrize("shape,data", [([1] * 65, b"\x01"), ([0, 2**63], b""), ([2**62, 0, 2], b"")],
                         ids=["65-dims", "empty-dim-2^63", "empty-over-2^63-bytes"])
def test_inspect_and_verify_refuse_what_the_loader_refuses(tmp_path, capsys, shape, data):
    """Shapes numpy cannot hold are a header rule, so inspect and verify say what a load says."""
    path = _hand_written(tmp_path / "limits.safetensors", shape, "F32" if data == b"" else "U8", data)
    with pytest.raises(fs.FormatError) as e:
        fs.load_file(path)
    assert e.value.rule == "shape-limits" and e.value.tensor == "t" and e.value.path == str(path)
    for args in (("inspect",), ("verify",), ("verify", "--headers-only")):
        code, _, err = main_inproc(capsys, *args, str(path))
        assert code == 1, args
        assert "[shape-limits]" in err and "'t'" in err and str(path) in err
    code, out, _ = main_inproc(capsys, "inspect", str(path), "--json")
    err = json.loads(out)
    assert code == 1 and err["valid"] is False
    assert (err["error"]["rule"], err["error"]["tensor"], err["error"]["path"]) == ("shape-limits", "t", str(path))
    if len(shape) > 64:   # and as a user runs it
        r = run("verify", str(path))
        assert r.returncode == 1 and "[shape-limits]" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_debug_shows_the_traceback(ckpt):
    with open(ckpt, "r+b") as f:
        f.write(b"\xff" * 8)   # absurd header length
    r = run("verify", str(ckpt), "--debug")
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "FormatError" in r.stderr and "header-too-large" in r.stderr


def test_missing_source(tmp_path):
    r = run("inspect", str(tmp_path / "nope.safetensors"))
    assert r.returncode == 1
    assert "nope.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("verify", str(tmp_path), "--headers-only")   # a directory with no checkpoint
    assert r.returncode == 1 and "no *.safetensors" in r.stderr


# ---------------------------------------------------------------- verify

def test_verify_good(ckpt, sharded):
    for source in (ckpt, sharded, sharded / "model.safetensors.index.json"):
        r = run("verify", str(source))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("OK ") and "every byte readable" in r.stdout
        assert "no checksums stored" in r.stdout
    r = run("verify", str(sharded), "--headers-only")
    assert r.returncode == 0 and "headers, index" in r.stdout and "no data read" in r.stdout


def test_verify_checksums(tmp_path, tensors):
    path = tmp_path / "summed.safetensors"
    fs.save_file(tensors, path, checksum="xxh3-64")
    r = run("verify", str(path), "--require-checksums")
    assert r.returncode == 0, r.stderr
    assert f"{len(tensors)} of {len(tensors)} tensors match their xxh3-64 digests" in r.stdout
    # One flipped byte inside a tensor: the header is still valid, the digest is not.
    hdr = raw_header(path)
    start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0] + hdr["embed.weight"]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[start + 100] ^= 0x40
    path.write_bytes(bytes(data))
    assert run("verify", str(path), "--headers-only").returncode == 0
    r = run("verify", str(path))
    assert r.returncode == 1
    assert "[checksum]" in r.stderr and "'embed.weight'" in r.stderr and str(path) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_verify_can_require_checksums(ckpt):
    r = run("verify", str(ckpt), "--require-checksums")
    assert r.returncode == 1 and "[checksum-missing]" in r.stderr


def test_verify_corrupt_header(ckpt):
    data = bytearray(ckpt.read_bytes())
    hdr_end = 8 + struct.unpack("<Q", data[:8])[0]
    text = data[8:hdr_end].decode()
    data[8:hdr_end] = text.replace('"F32"', '"F99"').encode()
    ckpt.write_bytes(bytes(data))
    r = run("verify", str(ckpt))
    assert r.returncode == 1
    assert "[unknown-dtype]" in r.stderr and "'embed.weight'" in r.stderr and str(ckpt) in r.stderr


def test_verify_index_naming_a_missing_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    r = run("verify", str(sharded))
    assert r.returncode == 1
    assert "[index-missing-file]" in r.stderr and shard.name in r.stderr


# ---------------------------------------------------------------- reshard

def test_reshard_round_trip(sharded, tmp_path, tensors):
    out = tmp_path / "out"
    r = run("reshard", str(sharded), str(out), "--max-shard-size", "4kB", "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert "shard(s)" in r.stdout and "%" not in r.stderr   # no progress bars in a pipe
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # The index lists every tensor exactly where it is, and the right total.
    for fname in files:
        names = set(raw_header(out / fname)) - {"__metadata__"}
        assert {k for k, v in index["weight_map"].items() if v == fname} == names
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    # Shards respect the limit unless one tensor alone exceeds it.
    for fname in files:
        entries = [v for k, v in raw_header(out / fname).items() if k != "__metadata__"]
        size = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries)
        assert size <= 4000 or len(entries) == 1
    # Byte-identical tensors, same dtypes and shapes.
    assert all_tensor_bytes(out) == all_tensor_bytes(sharded)
    # The source's metadata, and one save id in every shard and the index.
    save = index["metadata"]["foxhunt.save"]
    assert len(save) == 32 and int(save, 16) >= 0
    assert all(raw_header(out / f)["__metadata__"] == {"format": "pt", "foxhunt.save": save} for f in files)


def test_reshard_to_one_file_equals_the_reference_serializer(sharded, tmp_path, tensors):
    out = tmp_path / "one"
    r = run("reshard", str(sharded), str(out), "--max-shard-size", "1GB")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    stn.save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_reshard_keeps_sub_byte_dtypes(tmp_path):
    src = tmp_path / "src.safetensors"
    fs.save_file({"f4": RawTensor(DTYPES["F4"], (4, 6), np.arange(12, dtype=np.uint8)),
                  "f6": RawTensor(DTYPES["F6_E3M2"], (4,), np.array([1, 2, 3], np.uint8)),
                  "x": np.arange(10, dtype=np.float32)}, src)
    r = run("reshard", str(src), str(tmp_path / "out"), "--max-shard-size", "24")
    assert r.returncode == 0, r.stderr
    assert all_tensor_bytes(tmp_path / "out") == tensor_bytes(src)


def test_reshard_with_checksums(ckpt, tmp_path, tensors):
    pytest.importorskip("google_crc32c")   # the checksum extra (installed with .[test])
    out = tmp_path / "summed"
    r = run("reshard", str(ckpt), str(out), "--max-shard-size", "10kB", "--checksum", "crc32c", "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert all_tensor_bytes(out) == tensor_bytes(ckpt)
    r = run("verify", str(out), "--require-checksums")
    assert r.returncode == 0, r.stderr
    assert f"{len(tensors)} of {len(tensors)} tensors match their crc32c digests" in r.stdout


def test_reshard_refuses_an_output_named_like_a_file(sharded, tmp_path):
    r = run("reshard", str(sharded), str(tmp_path / "out.safetensors"), "--max-shard-size", "4kB")
    assert r.returncode == 1
    assert "out.safetensors: a name ending in .safetensors" in r.stderr and "directory of shards" in r.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_reshard_refuses_to_overwrite(sharded, ckpt, tmp_path):
    r = run("reshard", str(sharded), str(ckpt.parent), "--max-shard-size", "1GB")
    assert r.returncode == 1 and "already holds a checkpoint" in r.stderr
    r = run("reshard", str(sharded), str(sharded), "--max-shard-size", "1GB")
    assert r.returncode == 1 and "holds the source" in r.stderr


# ---------------------------------------------------------------- progress bars

def test_progress_bars_only_when_asked_or_on_a_terminal(tmp_path):
    code = """
import sys, numpy as np, foxhunt_stream as fs
flag = {"True": True, "None": None, "False": False}[sys.argv[1]]
t = {"a": np.ones((256, 1024), np.float32), "b": np.zeros(1000, np.int8)}
fs.save_file(t, sys.argv[2], progress=flag)
fs.load_file(sys.argv[2], progress=flag)
fs.load_into({"a": np.empty((256, 1024), np.float32), "b": np.empty(1000, np.int8)}, sys.argv[2], progress=flag)
with fs.safe_open(sys.argv[2]) as f:
    list(f.tensors(progress=flag))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    results = {}
    for flag in ("True", "None", "False"):
        r = subprocess.run([sys.executable, "-c", code, flag, str(tmp_path / f"{flag}.safetensors")],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        results[flag] = r.stderr
    bars = results["True"]
    assert bars.count("save: 100%") == 1 and bars.count("load: 100%") == 3
    assert "1.05M" in bars     # bytes counted: 1,048,576 + 1,000 for each bar
    assert results["None"] == "" and results["False"] == ""


def test_progress_bar_choice():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert progress_bar(10, "load", None, stream=Tty()).active
    assert not progress_bar(10, "load", None, stream=io.StringIO()).active
    assert not progress_bar(10, "load", False, stream=Tty()).active
    bar = progress_bar(10, "load", True, stream=io.StringIO())
    assert bar.active
    bar.update(10)
    bar.close()
    bar.close()   # idempotent
    with pytest.raises(TypeError):
        progress_bar(10, "load", "yes")
