"""Tiny transformers checkpoints (``save_pretrained``) and the comparison with transformers' own
``from_pretrained`` that the fs.transformers tests share (CPU and GPU)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
GENERATION = {"do_sample": True, "temperature": 0.5, "top_k": 7, "max_new_tokens": 3, "bos_token_id": 1,
              "eos_token_id": 2}


def configs() -> dict:
    """name -> (config, class that saves it, save_pretrained keywords)."""
    t = transformers
    return {
        "llama": (t.LlamaConfig(**SMALL, tie_word_embeddings=False), t.AutoModelForCausalLM, {}),
        "qwen2-tied": (t.Qwen2Config(**SMALL, tie_word_embeddings=True), t.AutoModelForCausalLM, {}),
        "gpt2-tied": (t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                   bos_token_id=1, eos_token_id=2), t.AutoModelForCausalLM, {}),
        "llama-sharded": (t.LlamaConfig(**SMALL, tie_word_embeddings=False), t.AutoModelForCausalLM,
                          {"max_shard_size": "20KB"}),
        "llama-base": (t.LlamaConfig(**SMALL), t.AutoModel, {}),
        "phi3-longrope": (t.Phi3Config(**dict(SMALL, max_position_embeddings=128, original_max_position_embeddings=32,
                                              pad_token_id=0, rope_scaling={"rope_type": "longrope",
                                                                            "short_factor": [1.0] * 4,
                                                                            "long_factor": [2.0] * 4})),
                          t.AutoModelForCausalLM, {}),
        "bert": (t.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64), t.AutoModelForMaskedLM, {}),
    }


def save_tiny(directory: str, name: str) -> str:
    """Random bf16 weights (float32 for GPT-2), a generation config with settings of its own."""
    config, cls, save = configs()[name]
    torch.manual_seed(len(name))
    dtype = torch.float32 if name.startswith("gpt2") else torch.bfloat16
    model = cls.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    path = os.path.join(directory, name)
    model.save_pretrained(path, **save)
    if hasattr(model, "generation_config"):
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(GENERATION, f)
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """name -> directory of that tiny checkpoint, made once per test run, on first use."""
    root = str(tmp_path_factory.mktemp("hf_tiny"))
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = save_tiny(root, name)
        return made[name]
    return get


def reference(path: str, device: str = "cpu", model_class=None, **kwargs):
    """transformers' own ``from_pretrained`` on ``device`` (``device_map`` needs accelerate;
    without it, loaded on the CPU and moved: the same tensors)."""
    model_class = model_class or transformers.AutoModelForCausalLM
    if device == "cpu":
        return model_class.from_pretrained(path, **kwargs)
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return model_class.from_pretrained(path, **kwargs).to(device)
    return model_class.from_pretrained(path, device_map=device, **kwargs)


def bits(t):
    """A tensor's bytes, for comparisons that see -0.0, NaN payloads and every dtype."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype.is_floating_point else t


def tie_groups(model) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


def assert_same_model(ref, ours, device: str = "cpu") -> None:
    """Every point of the contract: class, state dict bit for bit, buffers (non-persistent ones
    too), ties, eval mode, config, generation config, parameters' flags, nothing left on meta."""
    assert type(ours) is type(ref)
    a, b = ref.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert b[k].device == torch.device(device), k
        assert torch.equal(bits(a[k]), bits(b[k])), k
    ra, rb = dict(ref.named_buffers()), dict(ours.named_buffers())
    assert list(ra) == list(rb)
    for k in ra:
        assert ra[k].dtype == rb[k].dtype and torch.equal(bits(ra[k]), bits(rb[k])), k
    assert [n for n, _ in ours.named_non_persistent_buffers()] == [n for n, _ in ref.named_non_persistent_buffers()]
    pa, pb = dict(ref.named_parameters()), dict(ours.named_parameters())
    assert [(n, p.requires_grad) for n, p in pa.items()] == [(n, p.requires_grad) for n, p in pb.items()]
    assert tie_groups(ours) == tie_groups(ref)
    assert not any(m.training for m in ours.modules())
    assert ours.config.to_dict() == ref.config.to_dict()
    assert hasattr(ours, "generation_config") == hasattr(ref, "generation_config")
    if hasattr(ref, "generation_config"):
        assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    assert not any(t.is_meta for t in list(ours.parameters()) + list(ours.buffers()))
    for (name, a), (_, b) in zip(ref.named_modules(), ours.named_modules(), strict=True):   # no forward left a trace
        assert sorted(vars(a)) == sorted(vars(b)), name
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in ours.modules())


def logits(model, device: str = "cpu"):
    x = torch.tensor([[1, 5, 7, 3]], device=device)
    with torch.no_grad():
        out = model(input_ids=x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state
