"""fs.transformers.from_pretrained on the CPU, checked against transformers' own from_pretrained
on tiny checkpoints: every point of the contract, the errors, and what goes to transformers."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest

from hf_tiny import SMALL, assert_same_model, logits, reference, tiny  # noqa: F401  (tiny: a fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import foxhunt_stream as fs  # noqa: E402
import foxhunt_stream.transformers as fst  # noqa: E402
from foxhunt_stream.models import hf  # noqa: E402
from thread_support import foxhunt_threads_at_work  # noqa: E402

REPORT = "transformers.modeling_utils"

SMALL_MOE = dict(SMALL, num_hidden_layers=1, num_local_experts=2, num_experts_per_tok=1)


def ours(path, **kwargs):
    return fst.from_pretrained(path, device="cpu", **kwargs)


def logged(fn, logger=REPORT, seed=123):
    """``fn()``'s result (or the exception it raised) and what it logged on ``logger``; seeded, so
    that tensors both loaders initialise at random come out the same."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        torch.manual_seed(seed)
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 -- compared by the caller
            out = e
    finally:
        log.removeHandler(handler)
    return out, buf.getvalue()


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gpt2-tied", "llama-sharded"])
def test_same_model_as_transformers(tiny, name):
    path = tiny(name)
    ref, got = reference(path), ours(path)
    assert_same_model(ref, got)
    assert torch.equal(logits(ref), logits(got))
    if name != "gpt2-tied":   # no buffer in GPT-2 (5.x): the rotary tables are the non-persistent ones
        assert {n for n, _ in got.named_non_persistent_buffers()} >= {"model.rotary_emb.inv_freq"}
    if name in ("qwen2-tied", "gpt2-tied"):
        assert got.lm_head.weight is got.get_input_embeddings().weight
    else:
        assert got.lm_head.weight.data_ptr() != got.get_input_embeddings().weight.data_ptr()
    assert got.generation_config.temperature == 0.5 and got.generation_config.top_k == 7


def test_position_id_buffers_and_tied_bias(tiny):
    """BERT: non-persistent position/token-type ids (not rotary), a decoder tied to the embeddings."""
    path = tiny("bert")
    ref = reference(path, model_class=transformers.AutoModelForMaskedLM)
    got = ours(path, model_class=transformers.AutoModelForMaskedLM)
    assert_same_model(ref, got)
    assert "bert.embeddings.position_ids" in dict(got.named_buffers())
    assert torch.equal(logits(ref), logits(got))


@pytest.mark.parametrize("source", ["directory", "index", "file"])
def test_sources(tiny, source):
    sharded, single = tiny("llama-sharded"), tiny("llama")
    path, ref_path = {"directory": (sharded, sharded),
                      "index": (os.path.join(sharded, "model.safetensors.index.json"), sharded),
                      "file": (os.path.join(single, "model.safetensors"), single)}[source]
    got = ours(path)
    assert_same_model(reference(ref_path), got)
    assert got.config.name_or_path == ref_path


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16, "float32", "auto"])
def test_dtype_follows_transformers(tiny, dtype):
    path = tiny("llama")
    kw = {} if dtype is None else {"dtype": dtype}
    got = ours(path, **kw)
    assert_same_model(reference(path, **kw), got)
    expected = {None: torch.bfloat16, "auto": torch.bfloat16, "float32": torch.float32}.get(dtype, dtype)
    assert got.dtype == expected


@pytest.mark.parametrize("name, index_dtype", [("qwen2-tied", None), ("llama-sharded", None),
                                               ("llama-sharded", "float16")])
def test_dtype_from_the_checkpoint_when_the_config_has_none(tiny, tmp_path, name, index_dtype):
    """No dtype in config.json: the index's metadata dtype, else the first floating tensor's."""
    path = str(tmp_path / "m")
    shutil.copytree(tiny(name), path)
    edit_json(os.path.join(path, "config.json"), lambda c: c.pop("dtype"))
    if index_dtype:
        edit_json(os.path.join(path, "model.safetensors.index.json"), lambda i: i["metadata"].update(dtype=index_dtype))
    got = ours(path, torch_dtype=None)
    assert got.dtype == (torch.float16 if index_dtype else torch.bfloat16)
    assert_same_model(reference(path), got)


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def test_base_model_from_a_causal_lm_checkpoint(tiny):
    """AutoModel: the base model's prefix is stripped, the head is reported unexpected, as by transformers."""
    path = tiny("llama")
    ref, ref_log = logged(lambda: reference(path, model_class=transformers.AutoModel))
    got, got_log = logged(lambda: ours(path, model_class=transformers.AutoModel))
    assert type(got).__name__ == "LlamaModel"
    assert_same_model(ref, got)
    assert "lm_head.weight" in got_log and "UNEXPECTED" in got_log and got_log == ref_log
    assert torch.equal(logits(ref), logits(got))


@pytest.mark.parametrize("cls", ["Qwen2ForCausalLM", "AutoModelForCausalLM"])
def test_config_keywords(tiny, cls):
    """Config overrides and the attention implementation, through an Auto class or a concrete one."""
    path = tiny("qwen2-tied")
    cls = getattr(transformers, cls)
    kw = dict(num_hidden_layers=1, attn_implementation="eager")
    got = ours(path, model_class=cls, **kw)
    assert_same_model(reference(path, model_class=cls, **kw), got)
    assert got.config.num_hidden_layers == 1 and got.config._attn_implementation == "eager"


def test_missing_weights_reported_and_initialised_as_by_transformers(tiny):
    """A causal LM from a base checkpoint: lm_head is MISSING, initialised at random -- with the
    same seed, to the same values as transformers' (same report, same order of init)."""
    path = tiny("llama-base")
    ref, ref_log = logged(lambda: reference(path))
    got, got_log = logged(lambda: ours(path))
    assert "MISSING" in got_log and "lm_head.weight" in got_log and got_log == ref_log
    assert_same_model(ref, got)


def test_size_mismatch_raises_as_transformers_does(tiny):
    path = tiny("llama")
    ref, ref_log = logged(lambda: reference(path, vocab_size=80))
    got, got_log = logged(lambda: ours(path, vocab_size=80))
    assert isinstance(got, RuntimeError) and type(got) is type(ref) and str(got) == str(ref)
    assert "MISMATCH" in got_log and got_log == ref_log


def test_size_mismatch_ignored_reinitialises_as_transformers_does(tiny):
    path = tiny("llama")
    kw = dict(vocab_size=80, ignore_mismatched_sizes=True, output_loading_info=True)
    (ref, ref_info), _ = logged(lambda: reference(path, **kw))
    (got, got_info), _ = logged(lambda: ours(path, **kw))
    assert got_info == ref_info and got_info["mismatched_keys"]
    assert_same_model(ref, got)


def loader_threads() -> set[threading.Thread]:
    return set(foxhunt_threads_at_work())


def test_no_loader_thread_left_after_an_error(tiny):
    before = loader_threads()
    with pytest.raises(RuntimeError):
        ours(tiny("llama"), vocab_size=80)
    assert loader_threads() <= before


@pytest.mark.parametrize("warm_forward", [True, False])
def test_a_read_error_reaches_the_caller(tiny, monkeypatch, warm_forward):
    """A read that fails while the model waits (in the warm-up forward or the final wait)."""
    from foxhunt_stream.io import source

    def fail(src, offset, length):
        raise OSError(errno.EIO, "injected")
    monkeypatch.setattr(source, "fault_hook", fail)
    before = loader_threads()
    with pytest.raises(OSError, match="injected"):
        ours(tiny("llama-sharded"), warm_forward=warm_forward)
    assert loader_threads() <= before


@pytest.mark.parametrize("same", [True, False])
def test_tied_weights_both_in_the_checkpoint(tiny, tmp_path, same):
    """Tied only if the two are equal (transformers compares them, then warns and unties)."""
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / "m")
    shutil.copytree(tiny("qwen2-tied"), path)
    state = load_file(os.path.join(path, "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = emb.clone() if same else emb + 1
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    ref, ref_log = logged(lambda: reference(path), logger=REPORT)
    got, got_log = logged(lambda: ours(path, warm_forward=True), logger=REPORT)
    assert_same_model(ref, got)
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == same
    assert got_log == ref_log


@pytest.mark.parametrize("name", ["qwen2-tied", "phi3-longrope"])
def test_warm_forward_leaves_no_trace(tiny, monkeypatch, name):
    """The warm-up forward (on by default for CUDA) changes nothing the caller can see, even
    where a first forward changes the model (longrope picks its tables and keeps a copy)."""
    calls = []
    warm = hf.warm_up
    monkeypatch.setattr(hf, "warm_up", lambda model, device: (calls.append(device), warm(model, device)))
    path = tiny(name)
    got = ours(path, warm_forward=True)
    assert calls == [torch.device("cpu")]
    assert_same_model(reference(path), got)
    ours(path)
    assert len(calls) == 1   # off by default on the CPU


def test_a_first_forward_can_change_a_model(tiny):
    """Why the warm-up undoes what it changed: transformers' own model after one forward."""
    path = tiny("phi3-longrope")
    ref, used = reference(path), reference(path)
    with torch.no_grad():
        used(input_ids=torch.zeros((1, 1), dtype=torch.long))
    with pytest.raises(AssertionError):
        assert_same_model(ref, used)


def test_generate_as_transformers(tiny):
    path = tiny("llama")
    x = torch.tensor([[1, 5, 7]])
    ref, got = reference(path), ours(path)
    assert torch.equal(ref.generate(x, do_sample=False, max_new_tokens=4),
                       got.generate(x, do_sample=False, max_new_tokens=4))


def test_the_load_starts_after_the_model_code_is_imported(tiny, monkeypatch):
    """Finding the class imports the architecture's modeling code (transformers imports lazily:
    seconds of pure Python); the load's threads would take the GIL from it, so it starts after."""
    order = []
    real_recipe, real_load = hf.recipe, fs.torch.load_file
    monkeypatch.setattr(hf, "recipe", lambda *a, **k: order.append("class found") or real_recipe(*a, **k))
    monkeypatch.setattr(fs.torch, "load_file", lambda *a, **k: order.append("load started") or real_load(*a, **k))
    path = tiny("llama")
    assert_same_model(reference(path), ours(path))
    assert order == ["class found", "load started"]


def test_a_dtype_per_sub_model_goes_to_transformers_before_any_load(tiny, monkeypatch, caplog):
    path = tiny("llama")
    calls = spy_on_transformers(monkeypatch, transformers.AutoModelForCausalLM)
    with caplog.at_level(logging.WARNING, logger="foxhunt_stream"):
        assert fst.from_pretrained(path, device="cpu", dtype={"": torch.float32}) == "T"
    assert calls == [(path, {"dtype": {"": torch.float32}})] and "a dtype per sub-model" in caplog.text


# ---------------------------------------------------------------- what goes to transformers

def spy_on_transformers(monkeypatch, cls):
    """Record calls to ``cls.from_pretrained`` (answering with a sentinel) and refuse our load."""
    calls = []
    monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda c, path, **kw: calls.append((path, kw)) or "T"))
    monkeypatch.setattr(fs.torch, "load_file", lambda *a, **k: pytest.fail("the streamed load started"))
    return calls


def test_quantized_checkpoint_goes_to_transformers(tiny, tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "q")
    shutil.copytree(tiny("llama"), path)
    edit_json(os.path.join(path, "config.json"),
              lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    calls = spy_on_transformers(monkeypatch, transformers.AutoModelForCausalLM)
    with caplog.at_level(logging.WARNING, logger="foxhunt_stream"):
        assert fst.from_pretrained(path, device="cuda:1", dtype=torch.bfloat16) == "T"
    assert calls == [(path, {"dtype": torch.bfloat16, "device_map": "cuda:1"})]
    assert "quantization_config" in caplog.text and "quantized" in caplog.text
    with pytest.raises(ValueError, match="whole directory"):   # a file other than the one transformers reads
        shutil.copy(os.path.join(path, "model.safetensors"), os.path.join(path, "other.safetensors"))
        fst.from_pretrained(os.path.join(path, "other.safetensors"), device="cpu")


@pytest.mark.parametrize("kwargs", [{"variant": "fp16"}, {"device_map": "auto"}, {"gguf_file": "x.gguf"}])
def test_keywords_only_transformers_implements(tiny, monkeypatch, kwargs):
    path = tiny("llama")
    calls = spy_on_transformers(monkeypatch, transformers.AutoModelForCausalLM)
    assert fst.from_pretrained(path, device="cpu", **kwargs) == "T"
    assert calls == [(path, kwargs)]


def test_hub_name_and_bin_weights_go_to_transformers(tiny, tmp_path, monkeypatch):
    calls = spy_on_transformers(monkeypatch, transformers.AutoModel)
    fst.from_pretrained("org/model", device="cpu", model_class=transformers.AutoModel)
    assert calls == [("org/model", {})]
    monkeypatch.undo()
    path = str(tmp_path / "bin")
    shutil.copytree(tiny("llama"), path)
    from safetensors.torch import load_file
    torch.save(load_file(os.path.join(path, "model.safetensors")), os.path.join(path, "pytorch_model.bin"))
    os.remove(os.path.join(path, "model.safetensors"))
    assert_same_model(reference(path), fst.from_pretrained(path, device="cpu"))


def test_weight_conversion_cancels_the_load_and_goes_to_transformers(tmp_path, caplog):
    """Mixtral's per-expert tensors are fused by transformers on load: known only once the model
    exists, after the load has started; it is cancelled and transformers loads the checkpoint."""
    config = transformers.MixtralConfig(**SMALL_MOE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    before = loader_threads()
    with caplog.at_level(logging.WARNING, logger="foxhunt_stream"):
        got = ours(str(tmp_path))
    assert "weight conversion" in caplog.text and loader_threads() <= before
    assert_same_model(reference(str(tmp_path)), got)



def test_a_broken_file_is_a_format_error(tiny, tmp_path):
    path = str(tmp_path / "broken")
    shutil.copytree(tiny("llama"), path)
    weights = os.path.join(path, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 100)
    with pytest.raises(fs.FormatError):
        ours(path)


def test_without_transformers_the_message_names_the_extra(tiny):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import foxhunt_stream.transformers as t\n"
            f"t.from_pretrained({tiny('llama')!r}, device='cpu')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pip install torch 'transformers>=5.17,<6'" in out.stderr
