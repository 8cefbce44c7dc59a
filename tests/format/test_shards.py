"""File shards (format.shards): the greedy grouping, the file names and the index's bytes."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from foxhunt_stream.format.shards import index_json, shard_names, split_shards

sizes_lists = st.lists(st.integers(0, 5000), max_size=30).map(lambda xs: [(f"t{i}", n) for i, n in enumerate(xs)])


@settings(max_examples=200, deadline=None)
@given(sizes_lists, st.integers(1, 6000))
def test_split_shards_keeps_order_and_the_limit(sizes, limit):
    groups = split_shards(sizes, limit)
    assert [n for g in groups for n in g] == [n for n, _ in sizes]   # every tensor once, in order
    assert groups and (all(groups) or groups == [[]])
    size = dict(sizes)
    for i, g in enumerate(groups):
        total = sum(size[n] for n in g)
        assert total <= limit or len(g) == 1          # only a tensor alone may exceed the limit
        if i + 1 < len(groups) and total <= limit:    # greedy: the next tensor did not fit
            nxt = groups[i + 1][0]
            assert total + size[nxt] > limit or size[nxt] > limit


def test_split_shards_puts_a_big_tensor_alone():
    assert split_shards([("a", 3), ("big", 50), ("b", 3), ("c", 3)], 8) == [["a"], ["big"], ["b", "c"]]
    assert split_shards([], 8) == [[]]


def test_shard_names_follow_hugging_face():
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_index_json_bytes():
    data = index_json({"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"}, 12)
    assert data == (b'{\n  "metadata": {\n    "total_size": 12\n  },\n  "weight_map": {\n'
                    b'    "a": "model-00001-of-00002.safetensors",\n    "b": "model-00002-of-00002.safetensors"\n'
                    b'  }\n}\n')
    assert json.loads(data)["weight_map"]["b"] == "model-00002-of-00002.safetensors"
