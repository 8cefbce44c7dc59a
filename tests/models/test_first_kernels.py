"""The first forward's kernels (``models.first_kernels``): which shapes are run, pure; the thread on
the CPU where torch is installed."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from foxhunt_stream.models.first_kernels import SCRATCH_LIMIT, KernelWarmer, attention_shape, gemm_shapes

LLAMA = {"model.embed_tokens.weight": (128256, 4096), "model.layers.0.input_layernorm.weight": (4096,),
         "model.layers.0.self_attn.q_proj.weight": (4096, 4096), "model.layers.0.self_attn.k_proj.weight": (1024, 4096),
         "model.layers.0.self_attn.v_proj.weight": (1024, 4096), "model.layers.0.self_attn.o_proj.weight": (4096, 4096),
         "model.layers.0.mlp.gate_proj.weight": (14336, 4096), "model.layers.0.mlp.up_proj.weight": (14336, 4096),
         "model.layers.0.mlp.down_proj.weight": (4096, 14336), "lm_head.weight": (128256, 4096)}


def test_each_matrix_shape_once_in_first_seen_order():
    assert gemm_shapes(LLAMA, 2, 1 << 40) == [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


def test_no_vector_no_stacked_experts_no_empty_matrix():
    shapes = {"norm": (64,), "experts": (8, 64, 32), "empty": (0, 32), "scalar": (), "w": (64, 32)}
    assert gemm_shapes(shapes, 4, 1 << 40) == [(64, 32)]


def test_a_vocabulary_sized_weight_is_not_made():
    """Llama-3's 128256 x 4096 bf16 (1 GiB) is over the scratch limit; a 32000-token one is not."""
    assert 128256 * 4096 * 2 > SCRATCH_LIMIT >= 32000 * 4096 * 2
    assert (32000, 4096) in gemm_shapes({"lm_head.weight": (32000, 4096)}, 2, 1 << 40)


def test_scratch_bounded_by_the_headroom_beside_the_load():
    """Each scratch weight fits in a sixteenth of what the load leaves free: none on a full device."""
    gate = 14336 * 4096 * 2
    assert (14336, 4096) in gemm_shapes(LLAMA, 2, 16 * gate)
    assert gemm_shapes(LLAMA, 2, 16 * gate - 16) == [(4096, 4096), (1024, 4096)]
    assert gemm_shapes(LLAMA, 2, 0) == []
    assert gemm_shapes(LLAMA, 2, -(1 << 30)) == []


def test_attention_shape_from_the_config():
    assert attention_shape(SimpleNamespace(num_attention_heads=32, hidden_size=4096)) == (32, 128)
    assert attention_shape(SimpleNamespace(num_attention_heads=16, hidden_size=2048, head_dim=256)) == (16, 256)
    text = SimpleNamespace(num_attention_heads=8, hidden_size=512)
    assert attention_shape(SimpleNamespace(get_text_config=lambda: text)) == (8, 64)
    assert attention_shape(SimpleNamespace(hidden_size=512)) is None


def test_the_thread_runs_the_kernels_on_the_cpu():
    torch = pytest.importorskip("torch")
    warmer = KernelWarmer({"q": (32, 16), "up": (48, 16), "down": (16, 48)},
                          SimpleNamespace(num_attention_heads=2, hidden_size=16), torch.float32, torch.device("cpu"))
    assert warmer.join() is not None and warmer.seconds > 0
    assert warmer.error is None


def test_an_error_on_the_thread_is_logged_not_raised(caplog):
    torch = pytest.importorskip("torch")
    with caplog.at_level(logging.DEBUG, logger="foxhunt_stream"):
        warmer = KernelWarmer({"w": (32, 16)}, SimpleNamespace(num_attention_heads=2, hidden_size=16),
                              torch.float32, "nonsense")
        warmer.join()
    assert warmer.error is not None
    assert "first forward's kernels" in caplog.text
