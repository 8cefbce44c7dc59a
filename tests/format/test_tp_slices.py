"""shard.py: the pure rank -> index rule, checked against numpy.array_split (not against itself)."""

import fnmatch

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from foxhunt_stream import Shard
from foxhunt_stream.format.tp import glob_matcher, shard_index, shard_shape, split_bounds


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 40), world=st.integers(1, 9))
def test_split_bounds_is_array_split(size, world):
    pieces = np.array_split(np.arange(size), world)
    for rank in range(world):
        a, b = split_bounds(size, world, rank)
        assert list(range(a, b)) == list(pieces[rank])


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=4), world=st.integers(1, 5), data=st.data())
def test_shard_index_selects_the_array_split_piece(shape, world, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = np.arange(int(np.prod(shape))).reshape(shape)
    pieces = np.array_split(x, world, axis=dim)
    for rank in range(world):
        sh = Shard(rank, world, dim)
        index = shard_index(shape, sh, "t")
        np.testing.assert_array_equal(x[index], pieces[rank])
        assert shard_shape(shape, sh, "t") == pieces[rank].shape


def test_replicate_is_none_and_keeps_shape():
    assert shard_index((4, 6), Shard(1, 2, None), "t") is None
    assert shard_shape((4, 6), Shard(1, 2, None), "t") == (4, 6)


def test_index_is_plain_basic_index():
    assert shard_index((10, 7, 3), Shard(1, 3, 1), "t") == (slice(None), slice(3, 5))
    assert shard_index((10, 7, 3), Shard(0, 2, -1), "t") == (slice(None), slice(None), slice(0, 2))


def test_mapping_rule_first_match_wins():
    sh = Shard(0, 2, {"*.q_proj.weight": 0, "*.o_proj.weight": 1, "*": None})
    assert sh.dim_for("model.layers.0.q_proj.weight") == 0
    assert sh.dim_for("model.layers.0.o_proj.weight") == 1
    assert sh.dim_for("model.norm.weight") is None
    assert Shard(0, 2, {"*": None, "*.q_proj.weight": 0}).dim_for("a.q_proj.weight") is None


_GLOB_PIECES = st.sampled_from(["*", "?", "[0-3]", "[!a]", ".", "a", "b", "q_proj", "layers", "[", "]", "\\", "("])


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(st.lists(_GLOB_PIECES, max_size=5).map("".join), max_size=6),
       names=st.lists(st.lists(st.sampled_from(["a", "b", ".", "1", "7", "q_proj", "layers", "[", "(", "\n"]),
                               max_size=6).map("".join), min_size=1, max_size=6))
def test_glob_matcher_is_the_first_fnmatchcase_that_matches(patterns, names):
    first = glob_matcher(tuple(patterns))
    for name in names:
        want = next((i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(name, p)), None)
        assert first(name) == want, (patterns, name)


def test_mapping_without_a_match_is_an_error_naming_the_tensor():
    with pytest.raises(ValueError, match=r"'lm_head.weight'.*'\*': None"):
        shard_index((4, 4), Shard(0, 2, {"*.q_proj.weight": 0}), "lm_head.weight")


def test_callable_rule():
    sh = Shard(1, 2, lambda n: 1 if n.endswith("down") else None)
    assert shard_index((4, 6), sh, "mlp.down") == (slice(None), slice(3, 6))
    assert shard_index((4, 6), sh, "mlp.up") is None
    with pytest.raises(TypeError, match="'x'"):
        shard_index((4,), Shard(0, 2, lambda n: "0"), "x")


def test_dim_out_of_range_names_tensor_and_shape():
    with pytest.raises(ValueError, match=r"'scale' has shape \[\] .*dim 0"):
        shard_index((), Shard(0, 2, 0), "scale")
    with pytest.raises(ValueError, match=r"'b' has shape \[5\].*dim 1"):
        shard_index((5,), Shard(0, 2, 1), "b")


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(rank=2, world_size=2), ValueError, "rank must be in"),
    (dict(rank=-1, world_size=2), ValueError, "rank must be in"),
    (dict(rank=0, world_size=0), ValueError, "world_size must be at least 1"),
    (dict(rank=0.0, world_size=2), TypeError, "rank must be an int"),
    (dict(rank=True, world_size=2), TypeError, "rank must be an int"),
    (dict(rank=0, world_size=2, dim="0"), TypeError, "dim must be an int or None"),
    (dict(rank=0, world_size=2, dim=True), TypeError, "dim must be an int or None"),
    (dict(rank=0, world_size=2, dim={"*": 1.5}), TypeError, r"dim\['\*'\]"),
    (dict(rank=0, world_size=2, dim={0: 1}), TypeError, "patterns must be strings"),
])
def test_invalid_shards_are_refused_at_construction(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        Shard(**kwargs)


def test_numpy_integer_dims_are_accepted():
    assert shard_index((4, 6), Shard(0, 2, np.int64(1)), "t") == (slice(None), slice(0, 3))
