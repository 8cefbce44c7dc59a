"""load_file(..., device_map={name or prefix: device}): resolution rules, validation before any
byte is read, chunk interleaving, and a host load that equals the plain one (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import foxhunt_stream as fs
from foxhunt_stream.io import source
from foxhunt_stream.cuda.devices import CPU, Device
from foxhunt_stream.engine.placement import device_for, parse_device_map, resolve_device_map
from foxhunt_stream.format.plan import interleave_by_device
from gpu_util import write_random_file
from plan_support import plan_of_sizes

C0, C1 = Device("cuda", 0), Device("cuda", 1)

NAMES = ["model.embed.w", "model.layers.0.mlp.w", "model.layers.0.attn.w", "model.layers.01.x",
         "model.layers.1.mlp.w", "model.norm.w", "lm_head.w"]


# ---------------------------------------------------------------- resolution (pure)

def test_longest_prefix_wins_at_dot_boundaries():
    dm = {"model": "cpu", "model.layers.0": "cuda:1", "model.layers.0.attn.w": 0, "": "cuda:2"}
    got = dict(zip(NAMES, resolve_device_map(NAMES, dm)))
    assert got["model.layers.0.mlp.w"] == C1            # prefix at a '.' boundary
    assert got["model.layers.0.attn.w"] == C0           # the exact name is the longest key
    assert got["model.layers.01.x"] == CPU              # "model.layers.0" is not a prefix of "...01"
    assert got["model.embed.w"] == CPU
    assert got["lm_head.w"] == Device("cuda", 2)        # the catch-all


def test_prefix_may_end_with_a_dot_and_exact_names_need_no_boundary():
    parsed = parse_device_map({"model.layers.": "cuda:1", "lm_head.w": "cuda:0"})
    assert device_for("model.layers.7.w", parsed) == C1
    assert device_for("model.layers", parsed) is None   # "model.layers." does not cover its own stem
    assert device_for("lm_head.w", parsed) == C0
    assert device_for("lm_head.weight", parsed) is None  # not a '.' boundary


def test_values_take_everything_parse_device_takes():
    torch = pytest.importorskip("torch")
    got = resolve_device_map(["a", "b.x", "c", "d"], {"a": "cpu", "b": torch.device("cuda", 1), "c": 3, "d": "cuda"})
    assert got == [CPU, C1, Device("cuda", 3), C0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "ab", "0", "1", "10"]), min_size=1, max_size=5).map(".".join),
       st.dictionaries(st.lists(st.sampled_from(["a", "b", "ab", "0", "1", "10"]), min_size=0, max_size=4)
                       .map(".".join), st.integers(0, 7), max_size=6))
def test_resolution_matches_the_definition(name, dm):
    """Against a brute-force reading of the rule: among keys equal to the name or a string
    prefix followed by '.', the longest wins."""
    parsed = {k: Device("cuda", v) for k, v in dm.items()}
    matching = [k for k in dm if k == "" or name == k or name.startswith(k + ".")]
    want = Device("cuda", dm[max(matching, key=len)]) if matching else None
    assert device_for(name, parsed) == want


def test_unmapped_names_are_listed_up_to_ten():
    names = [f"x.{i}" for i in range(25)] + ["y.0"]
    with pytest.raises(ValueError, match=r"no device for 25 selected tensor\(s\)") as e:
        resolve_device_map(names, {"y": "cpu"})
    assert "x.9'" in str(e.value) and "x.10'" not in str(e.value)


def test_invalid_device_names_its_key():
    with pytest.raises(fs.DeviceError, match=r"device_map\['model.layers'\]: invalid device 'gpu:1'"):
        parse_device_map({"model.layers": "gpu:1"})
    with pytest.raises(ValueError, match="empty"):
        parse_device_map({})
    with pytest.raises(TypeError, match="keys are tensor names"):
        parse_device_map({0: "cpu"})
    with pytest.raises(TypeError, match="mapping"):
        parse_device_map("cuda:0")


# ---------------------------------------------------------------- interleaving (pure)

def _plan(sizes, chunk=4):
    return plan_of_sizes(sizes, chunk)


def test_interleave_alternates_devices_and_keeps_each_devices_order():
    plan = _plan([8, 8, 8, 8])                  # 2 chunks each; t0,t1 -> cuda:0, t2,t3 -> cuda:1
    devs = [C0, C0, C1, C1]
    out = interleave_by_device(plan, devs)
    assert sorted(out.chunks, key=plan.chunks.index) == list(plan.chunks)   # a permutation
    assert [devs[c.dest] for c in out.chunks] == [C0, C1] * 4
    for d in (C0, C1):
        assert [c for c in out.chunks if devs[c.dest] == d] == [c for c in plan.chunks if devs[c.dest] == d]
    assert out.chunks_per_dest == plan.chunks_per_dest and out.destinations == plan.destinations


def test_interleave_is_proportional_to_bytes_and_a_no_op_for_one_device():
    plan = _plan([12, 4])                       # cuda:0 has 3 chunks, cuda:1 one
    out = interleave_by_device(plan, [C0, C1])
    assert [c.dest for c in out.chunks] == [0, 1, 0, 0]
    assert interleave_by_device(plan, [C0, C0]) is plan


# ---------------------------------------------------------------- load_file

@pytest.fixture()
def ckpt(tmp_path):
    path = str(tmp_path / "m.safetensors")
    raw = write_random_file(path, [(n, "F32", (4, 5)) for n in NAMES] + [("empty", "BF16", (0, 3))])
    return path, raw


def test_all_cpu_map_equals_a_plain_load(ckpt):
    path, raw = ckpt
    plain = fs.load_file(path)
    mapped = fs.load_file(path, device_map={"model.layers": "cpu", "": "cpu"})
    assert mapped.keys() == plain.keys() == raw.keys()
    for n, v in mapped.items():
        assert isinstance(v, np.ndarray) and v.tobytes() == raw[n] and v.shape == plain[n].shape


def test_map_works_with_names_shard_verify_and_background(ckpt, tmp_path):
    path, raw = ckpt
    out = fs.load_file(path, device_map={"model.layers": "cpu"}, names="model.layers.*", background=True).result()
    assert sorted(out) == sorted(n for n in raw if n.startswith("model.layers."))   # others need no mapping
    assert all(a.tobytes() == raw[n] for n, a in out.items())
    sharded = fs.load_file(path, device_map={"": "cpu"}, shard=fs.Shard(1, 2, 0), names=["lm_head.w"])
    assert sharded["lm_head.w"].tobytes() == raw["lm_head.w"][40:]
    summed = str(tmp_path / "sums.safetensors")
    fs.save_file(fs.load_file(path), summed, checksum="xxh3-64")
    assert fs.load_file(summed, device_map={"": "cpu"}, verify=True)["model.norm.w"].tobytes() == raw["model.norm.w"]


def test_torch_drop_in_takes_a_map(ckpt, torch):
    path, raw = ckpt
    out = fs.torch.load_file(path, device_map={"": "cpu"})
    assert out["lm_head.w"].numpy().tobytes() == raw["lm_head.w"]
    out = fs.load_file(path, device_map={"model.layers": "cpu"}, names="model.layers.*", framework="pt",
                       background=True).result()
    assert sorted(out) == sorted(n for n in raw if n.startswith("model.layers."))
    assert all(t.device.type == "cpu" and t.numpy().tobytes() == raw[n] for n, t in out.items())


@pytest.fixture()
def no_reads(monkeypatch):
    """Fails the test if any tensor byte is read; yields the read counter's start."""
    def refuse(src, offset, length):
        raise AssertionError(f"read {length} bytes at {offset} of {src.path}")
    monkeypatch.setattr(source, "fault_hook", refuse)
    before = source.total_bytes_read()
    yield
    assert source.total_bytes_read() == before


def test_unmapped_tensor_fails_before_reading(ckpt, no_reads):
    path, _ = ckpt
    with pytest.raises(ValueError, match=r"no device for 3 selected tensor\(s\), e.g. \['lm_head.w', "
                                         r"'model.embed.w', 'model.norm.w'\]"):
        fs.load_file(path, device_map={"model.layers": "cpu", "empty": "cpu"})


def test_missing_gpu_fails_before_reading(ckpt, no_reads):
    path, _ = ckpt
    with pytest.raises(fs.DeviceError):
        fs.load_file(path, device_map={"model.layers": "cuda:63", "": "cpu"})


def test_invalid_device_fails_before_opening(no_reads, tmp_path):
    with pytest.raises(fs.DeviceError, match=r"device_map\['lm_head'\]"):
        fs.load_file(str(tmp_path / "does-not-exist.safetensors"), device_map={"lm_head": "cuda:x"})


@pytest.mark.parametrize("device", ["cuda:0", 0, "cpu:0"])
def test_device_and_device_map_conflict(ckpt, no_reads, device):
    path, _ = ckpt
    with pytest.raises(ValueError, match="either device .* or device_map"):
        fs.load_file(path, device=device, device_map={"": "cpu"})


def test_default_device_spelled_out_is_not_a_conflict(ckpt):
    path, raw = ckpt
    assert fs.load_file(path, device="cpu", device_map={"": "cpu"})["lm_head.w"].tobytes() == raw["lm_head.w"]


def test_process_group_and_device_map_are_refused(ckpt, no_reads):
    path, _ = ckpt
    with pytest.raises(ValueError, match="not supported together"):
        fs.load_file(path, device_map={"": "cpu"}, process_group=object())
