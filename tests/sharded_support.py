"""A small sharded checkpoint (three files and an index) and a per-name TP rule, shared by the
host and GPU tests of sharded loads. Written with the reference serializer (safetensors.numpy)."""

import json
import os

import ml_dtypes
import numpy as np
import safetensors.numpy as stn

from foxhunt_stream.io.checkpoint import INDEX_NAME

SHARDS = {
    "model-00001-of-00003.safetensors": ["embed.weight", "layers.0.q_proj.weight", "layers.0.o_proj.weight"],
    "model-00002-of-00003.safetensors": ["layers.0.mlp.w", "layers.0.norm", "scale", "empty"],
    "model-00003-of-00003.safetensors": ["layers.1.q_proj.weight", "layers.1.o_proj.weight", "lm_head.weight"],
}


def make_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((11, 6)).astype(np.float32),
        "layers.0.q_proj.weight": rng.integers(-1000, 1000, (7, 10)).astype(np.int16),
        "layers.0.o_proj.weight": rng.standard_normal((10, 7)).astype(np.float32),
        "layers.0.mlp.w": rng.standard_normal((5, 9, 4)).astype(np.float32),
        "layers.0.norm": rng.standard_normal(13).astype(np.float32),
        "scale": np.array(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "layers.1.q_proj.weight": rng.standard_normal((7, 10)).astype(np.float16),
        "layers.1.o_proj.weight": rng.standard_normal((10, 7)).astype(np.float64),
        "lm_head.weight": rng.standard_normal((9, 5)).astype(ml_dtypes.bfloat16),
    }


def write_checkpoint(d, tensors, shards=SHARDS, metadata=None, index_metadata=None, weight_map=None):
    os.makedirs(d, exist_ok=True)
    for fname, names in shards.items():
        stn.save_file({n: tensors[n] for n in names}, os.path.join(d, fname), metadata=metadata)
    wm = weight_map if weight_map is not None else {n: f for f, names in shards.items() for n in names}
    index = {"metadata": index_metadata if index_metadata is not None else {"total_size": 1234}, "weight_map": wm}
    with open(os.path.join(d, INDEX_NAME), "w") as f:
        json.dump(index, f)
    return d


RULE = {"*.q_proj.weight": 0, "*.o_proj.weight": 1, "layers.0.mlp.w": -1, "embed.weight": 0,
        "lm_head.weight": -1, "layers.0.norm": 0, "*": None}
