"""fs.transformers.from_pretrained on a CUDA device against transformers' own from_pretrained
(skips cleanly without torch, transformers or a GPU)."""

from __future__ import annotations

import pytest

from hf_tiny import SMALL, assert_same_model, logits, reference, tiny  # noqa: F401  (tiny: a fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import foxhunt_stream.transformers as fst  # noqa: E402
from foxhunt_stream.models import hf  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda:0"


@pytest.fixture(autouse=True)
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.parametrize("warm_forward", [None, False])
@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "llama-sharded", "gpt2-tied"])
def test_same_model_as_transformers_on_the_gpu(tiny, name, warm_forward):
    path = tiny(name)
    got = fst.from_pretrained(path, device=DEV, warm_forward=warm_forward)
    ref = reference(path, device=DEV)
    assert_same_model(ref, got, device=DEV)
    assert torch.equal(logits(ref, DEV), logits(got, DEV))


def test_cast_on_the_gpu(tiny):
    path = tiny("llama")
    got = fst.from_pretrained(path, device=DEV, dtype=torch.float32)
    assert_same_model(reference(path, device=DEV, dtype=torch.float32), got, device=DEV)


def test_warm_forward_streams_a_larger_model(tmp_path, monkeypatch):
    """Some MB in many chunks: the warm-up forward runs while the layers land (on by default on
    CUDA) and the model that comes back is transformers' own."""
    calls = []
    warm = hf.warm_up
    monkeypatch.setattr(hf, "warm_up", lambda model, device: (calls.append(device), warm(model, device)))
    config = transformers.LlamaConfig(**dict(SMALL, vocab_size=4096, hidden_size=512, intermediate_size=1536,
                                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path), max_shard_size="8MB")
    got = fst.from_pretrained(str(tmp_path), device=DEV)
    assert calls == [torch.device(DEV)]
    ref = reference(str(tmp_path), device=DEV)
    assert_same_model(ref, got, device=DEV)
    assert torch.equal(logits(ref, DEV), logits(got, DEV))


@pytest.mark.parametrize("warm_forward", [None, False])
def test_the_first_kernels_run_beside_the_load_and_end_before_the_return(tiny, monkeypatch, warm_forward):
    """With the warm forward (CUDA's default) a thread runs the checkpoint's GEMM shapes from the
    load's start, and has ended without error when from_pretrained returns; without it, no thread."""
    warmers = []

    class Recorded(hf.KernelWarmer):
        def __init__(self, shapes, config, dtype, device):
            warmers.append(self)
            self.shapes = dict(shapes)
            super().__init__(shapes, config, dtype, device)
    monkeypatch.setattr(hf, "KernelWarmer", Recorded)
    path = tiny("llama")
    got = fst.from_pretrained(path, device=DEV, warm_forward=warm_forward)
    if warm_forward is False:
        assert warmers == []
        return
    [warmer] = warmers
    assert warmer.shapes and set(warmer.shapes) <= set(got.state_dict())   # the checkpoint's tensors
    assert warmer.seconds is not None and warmer.error is None   # (seconds: set as its thread ends)
