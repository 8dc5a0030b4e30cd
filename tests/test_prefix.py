"""Prefix reuse (design.md §9): save a document's compressed state, load it in this or another process,
share one document across a batch of questions, and refuse every file that does not fit.

A document is prefilled once (`ShadowKVCache.prefill`); `generate` then gets the document ids followed by the
question's. The reference for a loaded prefix is the in-memory prefix it was saved from; the reference for a
question in a shared batch is the same question asked alone.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_logits_close,
    dynamic_cache,
    forward_with,
    full_budget_overrides,
    generate_with,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from shadowkv_cache import LandmarkTopK, PrefixCacheError, ShadowKVCache, unpatch_model
from shadowkv_cache.fidelity import natural_text_ids
from shadowkv_cache.hf.adapters import _ADAPTERS
from shadowkv_cache.prefix import FORMAT_VERSION, METADATA_KEY, batch_questions

DOC = 240  # tokens: 26 chunks of 8 after the local window, so selection and rebuild really run
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def document():
    return random_prompt(DOC, seed=500)[0]


@pytest.fixture(scope="module")
def question():
    return random_prompt(6, seed=501)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, document):
    """A prefix file of the shared tiny Llama at the small budget, and the cache it was saved from."""
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("prefix") / "doc.safetensors"
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    doc.save_prefix(path)
    return path, doc


def ask(model, cache, document, question, **kwargs):
    return generate_with(model, torch.cat([document, question])[None], cache, max_new_tokens=NEW_TOKENS, **kwargs)


def rewrite(src: Path, dst: Path, edit_meta=None, edit_tensors=None) -> Path:
    """A valid safetensors copy of `src` with its prefix metadata and/or tensors edited."""
    with safe_open(src, framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst, metadata={METADATA_KEY: json.dumps(meta)})
    return dst


# -- a loaded prefix is the prefix it was saved from ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loaded_prefix_generates_what_the_original_does(tmp_path, arch, document, question):
    model = tiny_model(arch)
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    assert all(layer.is_compressed for layer in doc.layers)
    doc.save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")

    assert loaded.get_seq_length() == DOC and torch.equal(loaded.prefix_ids, document)
    assert loaded.config == doc.config
    original = ask(model, doc.fork(), document, question)
    again = ask(model, loaded, document, question)
    assert torch.equal(again.sequences, original.sequences)
    assert_logits_close(again.logits, original.logits, rtol=0, atol=0)  # the very same tensors
    assert loaded.memory_report().hit_rate is not None  # selection and rebuild ran


def test_full_budget_prefix_matches_dynamic_cache(tmp_path, document, question):
    """At full rank and budget ShadowKV is exact: a loaded prefix + question = DynamicCache on both."""
    model = tiny_model("mistral")
    ShadowKVCache.prefill(model, document, **full_budget_overrides()).save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    out = ask(model, loaded, document, question)
    ref = ask(model, dynamic_cache(model), document, question)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


def test_a_short_document_stays_exact_and_round_trips(tmp_path, question):
    model = tiny_model("qwen2")
    short = random_prompt(40, seed=502)[0]  # below min_compress_len = 64
    doc = ShadowKVCache.prefill(model, short, **small_budget_overrides())
    assert not any(layer.is_compressed for layer in doc.layers)
    doc.save_prefix(tmp_path / "short.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "short.safetensors")
    out = ask(model, loaded, short, question)
    ref = ask(model, dynamic_cache(model), short, question)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


def test_sparse_budget_may_change_at_load(saved, document, question):
    path, _ = saved
    model = tiny_model("llama")
    loaded = ShadowKVCache.load_prefix(model, path, sparse_budget=64)
    assert loaded.layers[0].prompt.max_budget_chunks == 8
    fresh = ShadowKVCache.prefill(model, document, **small_budget_overrides(sparse_budget=64))
    out, ref = ask(model, loaded, document, question), ask(model, fresh, document, question)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


LOAD_SCRIPT = """
import sys, torch
sys.path[:0] = {paths}
from helpers import make_tiny_model, random_prompt
from shadowkv_cache import ShadowKVCache
model = make_tiny_model("llama")  # the same seeded weights as the parent's tiny Llama
cache = ShadowKVCache.load_prefix(model, {path!r})
ids = torch.cat([cache.prefix_ids, random_prompt(6, seed=501)[0]])[None]
with torch.no_grad():
    out = model.generate(ids, past_key_values=cache, max_new_tokens={new}, do_sample=False)
print(" ".join(map(str, out[0, ids.shape[1]:].tolist())))
"""


def test_reuse_from_a_second_process(saved, document, question):
    path, doc = saved
    tests = Path(__file__).resolve().parent
    script = LOAD_SCRIPT.format(paths=[str(tests), str(tests.parent / "src")], path=str(path), new=NEW_TOKENS)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    here = ask(tiny_model("llama"), doc.fork(), document, question)
    assert result.stdout.split() == [str(t) for t in here.sequences[0, -NEW_TOKENS:].tolist()]


# -- one document, many questions -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_batch_gives_each_question_what_it_gets_alone(arch, document):
    """`[document][left-padded question]`: pads sit between the document and the question, and are neither
    attended nor scored; positions skip them, so each row equals its question asked alone."""
    model = tiny_model(arch)
    questions = [random_prompt(n, seed=510 + n)[0] for n in (7, 2, 12)]
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    ids, mask = batch_questions(doc.prefix_ids, questions, pad_token_id=0)
    assert ids.shape == (3, DOC + 12) and mask[1].tolist() == [1] * DOC + [0] * 10 + [1] * 2
    shared = doc.fork(batch_size=3)
    batch = generate_with(model, ids, shared, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for i, q in enumerate(questions):
        alone = ask(model, doc.fork(), document, q)
        assert torch.equal(batch.sequences[i, -NEW_TOKENS:], alone.sequences[0, -NEW_TOKENS:]), f"question {i}"
        assert_logits_close([step[i : i + 1] for step in batch.logits], alone.logits)


def test_shared_batch_holds_one_copy_of_the_document(document):
    model = tiny_model("llama")
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    one, many = doc.fork(1), doc.fork(16)
    for d, m in zip(doc.layers, many.layers):
        assert m.prompt.values.data is d.prompt.values.data  # host values: the same tensor
        assert m.prompt.a.shape[0] == 16 and m.prompt.a.stride(0) == 0  # device: views of one copy
        assert m.prompt.a.data_ptr() == d.prompt.a.data_ptr()
        assert m.prompt.policy_state["landmarks"].data_ptr() == d.prompt.policy_state["landmarks"].data_ptr()
        assert m.mode.temporal.keys.shape[0] == 16  # per question: its own temporal cache
    report_one, report_many = one.memory_report(), many.memory_report()
    assert report_many.host_bytes == report_one.host_bytes
    temporal = sum(layer.mode.temporal.nbytes for layer in one.layers)
    assert report_many.gpu_bytes == report_one.gpu_bytes + 15 * temporal


def test_forking_leaves_the_document_reusable(document, question):
    model = tiny_model("llama")
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    first = ask(model, doc.fork(), document, question)
    assert doc.get_seq_length() == DOC and doc.layers[0].mode.temporal.ids.eq(-1).all()
    second = ask(model, doc.fork(), document, question)
    assert torch.equal(first.sequences, second.sequences)
    used = doc.fork()
    ask(model, used, document, question)
    with pytest.raises(PrefixCacheError, match="holds only a document"):
        used.fork()  # it now holds a question and an answer


def test_beam_search_over_a_shared_document_runs(document, question):
    model = tiny_model("llama")
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    out = ask(model, doc.fork(3), document, question, num_beams=3)
    assert out.sequences.shape == (1, DOC + 6 + NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_smollm2_document_saved_loaded_and_shared(smollm2, tmp_path):
    """The real model (30 layers, GQA 9/3): a loaded prefix answers a batch of two questions as the in-memory
    document answers each alone."""
    model, tokenizer = smollm2
    text = natural_text_ids(tokenizer, 700)[0]
    document, questions = text[:600], [text[600:612], text[650:655]]
    doc = ShadowKVCache.prefill(model, document, min_compress_len=256, sparse_budget=64)
    assert all(layer.is_compressed for layer in doc.layers)
    doc.save_prefix(tmp_path / "smollm2.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "smollm2.safetensors")
    ids, mask = batch_questions(loaded.prefix_ids, questions, pad_token_id=tokenizer.pad_token_id or 0)
    batch = generate_with(model, ids, loaded.fork(2), attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for i, q in enumerate(questions):
        alone = ask(model, doc.fork(), document, q)
        steps = alone.sequences.shape[1] - len(document) - len(q)  # fewer if it ended early
        assert torch.equal(batch.sequences[i, ids.shape[1] : ids.shape[1] + steps], alone.sequences[0, -steps:])
        assert_logits_close([step[i : i + 1] for step in batch.logits[:steps]], alone.logits, rtol=1e-4, atol=1e-4)


# -- generate checks the ids it gets ---------------------------------------------------------------------------


def test_generate_refuses_ids_that_do_not_start_with_the_prefix(saved, document, question):
    _, doc = saved
    model = tiny_model("llama")
    cache = doc.fork()
    other = document.clone()
    other[100] = (other[100] % 100) + 1
    with pytest.raises(PrefixCacheError, match="differs first at token 100"):
        ask(model, cache, other, question)
    with pytest.raises(PrefixCacheError, match="followed by the question"):
        generate_with(model, question[None], cache, max_new_tokens=2)
    with pytest.raises(PrefixCacheError, match=r"fork\(batch_size=2\)"):
        generate_with(model, torch.cat([document, question])[None].expand(2, -1), cache, max_new_tokens=2)
    assert cache.get_seq_length() == DOC  # nothing ran
    ask(model, cache, document, question)  # and the cache still works


# -- files that do not fit -------------------------------------------------------------------------------------


@pytest.fixture
def fresh_model():
    model = make_tiny_model("llama")  # the same weights as the shared tiny Llama, not yet patched
    yield model
    unpatch_model(model)


def test_another_model_is_refused_before_anything_changes(saved):
    path, _ = saved
    deeper = make_tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(PrefixCacheError, match="num_hidden_layers: 2 in the file, 3 here"):
        ShadowKVCache.load_prefix(deeper, path)
    assert deeper not in _ADAPTERS  # the model was not even patched
    with pytest.raises(PrefixCacheError, match="model_type"):
        ShadowKVCache.load_prefix(make_tiny_model("qwen2"), path)


def test_other_weights_of_the_same_config_are_refused(saved):
    path, _ = saved
    with pytest.raises(PrefixCacheError, match="same config but other weights"):
        ShadowKVCache.load_prefix(make_tiny_model("llama", seed=99), path)


def test_another_dtype_is_refused(saved):
    path, _ = saved
    with pytest.raises(PrefixCacheError, match="float32 keys/values but this model computes bfloat16"):
        ShadowKVCache.load_prefix(make_tiny_model("llama").to(torch.bfloat16), path)


@pytest.mark.parametrize(
    "overrides, named", [({"rank": 16}, "rank: 8 in the file, 16 here"), ({"chunk_size": 4}, "chunk_size")]
)
def test_another_shadowkv_config_is_refused(saved, fresh_model, overrides, named):
    path, _ = saved
    with pytest.raises(PrefixCacheError, match=named):
        ShadowKVCache.load_prefix(fresh_model, path, **overrides)
    assert fresh_model not in _ADAPTERS


def test_another_policy_is_refused(saved, fresh_model):
    class OtherPolicy(LandmarkTopK):
        pass

    with pytest.raises(PrefixCacheError, match="LandmarkTopK selection policy"):
        ShadowKVCache.load_prefix(fresh_model, saved[0], policy=OtherPolicy())


def test_a_wrong_version_is_refused(saved, fresh_model, tmp_path):
    path = rewrite(saved[0], tmp_path / "v2.safetensors", edit_meta=lambda m: m.update(version=FORMAT_VERSION + 1))
    with pytest.raises(PrefixCacheError, match=f"version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}"):
        ShadowKVCache.load_prefix(fresh_model, path)


def test_a_truncated_file_is_refused(saved, fresh_model, tmp_path):
    raw = saved[0].read_bytes()
    for cut in (len(raw) - 1, len(raw) // 2, 5):
        (tmp_path / "cut.safetensors").write_bytes(raw[:cut])
        with pytest.raises(PrefixCacheError, match="truncated"):
            ShadowKVCache.load_prefix(fresh_model, tmp_path / "cut.safetensors")
    assert fresh_model not in _ADAPTERS


TAMPERINGS = {
    "prefix length": (lambda m: m.update(prefix_length=DOC + 8), None, "tensor token_ids is"),
    "token hash": (lambda m: m.update(token_ids_sha256="0" * 64), None, "do not match their hash"),
    "config hash": (lambda m: m["model"].update(config_sha256="0" * 64), None, "does not match its hash"),
    "config": (lambda m: m["shadowkv_config"].update(rank=16), None, r"ranks \[8, 8\] do not fit .* rank 16"),
    "no metadata": (lambda m: m.clear(), None, "not a shadowkv_cache prefix"),
    "tensor shape": (None, lambda t: t.update({"layers.1.a": t["layers.1.a"][:, :-8]}), "layers.1.a is"),
    "tensor dtype": (None, lambda t: t.update({"layers.0.b": t["layers.0.b"].double()}), "F64, expected"),
    "missing tensor": (None, lambda t: t.pop("layers.0.local_valid"), "missing"),
    "positions": (None, lambda t: t["layers.0.positions"].add_(1), "positions and masks"),
    "token ids": (None, lambda t: t["token_ids"].add_(1), "do not match their hash"),
}


@pytest.mark.parametrize("case", TAMPERINGS, ids=list(TAMPERINGS))
def test_a_tampered_file_says_what_is_wrong(saved, fresh_model, tmp_path, case):
    edit_meta, edit_tensors, message = TAMPERINGS[case]
    path = rewrite(saved[0], tmp_path / "tampered.safetensors", edit_meta, edit_tensors)
    with pytest.raises(PrefixCacheError, match=message):
        ShadowKVCache.load_prefix(fresh_model, path)
    assert fresh_model not in _ADAPTERS


def test_files_that_are_not_prefixes(fresh_model, tmp_path):
    with pytest.raises(PrefixCacheError, match="No prefix file"):
        ShadowKVCache.load_prefix(fresh_model, tmp_path / "missing.safetensors")
    save_file({"x": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(PrefixCacheError, match="not a shadowkv_cache prefix"):
        ShadowKVCache.load_prefix(fresh_model, tmp_path / "plain.safetensors")
    (tmp_path / "pickle.pt").write_bytes(b"\x80\x04K\x01.")  # a pickle is never unpickled
    with pytest.raises(PrefixCacheError, match="not a readable safetensors file"):
        ShadowKVCache.load_prefix(fresh_model, tmp_path / "pickle.pt")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_load_soundly_or_raise_prefix_cache_error(saved, tmp_path, data):
    """Bytes overwritten in the header (tensor table + metadata) or anywhere, or the file cut short: the loader
    raises `PrefixCacheError` and nothing else. Every tensor carries a digest, so damaged data does not load
    either; a file that loads (a byte overwritten with itself) must be a sound cache that generates."""
    raw = bytearray(saved[0].read_bytes())
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    kind = data.draw(st.sampled_from(["header", "anywhere", "truncate"]))
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        end = header_end if kind == "header" else len(raw)
        for at in data.draw(st.lists(st.integers(0, end - 1), min_size=1, max_size=6)):
            raw[at] = data.draw(st.integers(0, 255))
    path = tmp_path / "fuzzed.safetensors"
    path.write_bytes(bytes(raw))
    model = tiny_model("llama")
    try:
        cache = ShadowKVCache.load_prefix(model, path)
    except PrefixCacheError:
        return
    assert cache.get_seq_length() == DOC
    ids = torch.cat([cache.prefix_ids, torch.tensor([5, 6])])[None]
    generate_with(model, ids, cache, max_new_tokens=2)


# -- saving ----------------------------------------------------------------------------------------------------


def test_save_needs_a_cache_that_holds_only_the_document(tmp_path, document, question):
    model = tiny_model("llama")
    used = ShadowKVCache(model, **small_budget_overrides())
    ask(model, used, document, question)
    with pytest.raises(PrefixCacheError, match="exactly the"):
        used.save_prefix(tmp_path / "x.safetensors", input_ids=document)
    with pytest.raises(PrefixCacheError, match="tokens after its compressed prompt"):  # the ids it holds: all of them
        used.save_prefix(tmp_path / "x.safetensors")
    plain = ShadowKVCache(model, **small_budget_overrides())
    forward_with(model, document[None], plain)  # a plain forward: the cache knows the ids it fed
    other = document.clone()
    other[7] = (other[7] % 100) + 1
    with pytest.raises(PrefixCacheError, match="not the document this cache holds"):
        plain.save_prefix(tmp_path / "x.safetensors", input_ids=other)
    plain.save_prefix(tmp_path / "x.safetensors")
    assert torch.equal(ShadowKVCache.load_prefix(model, tmp_path / "x.safetensors").prefix_ids, document)
    embedded = ShadowKVCache(model, **small_budget_overrides())
    with torch.no_grad():  # filled from embeddings: the ids must be given
        forward_with(model, None, embedded, inputs_embeds=model.get_input_embeddings()(document[None]))
    with pytest.raises(PrefixCacheError, match="needs the document's ids"):
        embedded.save_prefix(tmp_path / "y.safetensors")
    embedded.save_prefix(tmp_path / "y.safetensors", input_ids=document)
    assert ShadowKVCache.load_prefix(model, tmp_path / "x.safetensors").get_seq_length() == DOC
    with pytest.raises(PrefixCacheError, match="one-row"):
        ShadowKVCache.prefill(model, document, **small_budget_overrides()).fork(2).save_prefix(tmp_path / "y")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(saved, tmp_path, monkeypatch, document):
    path = tmp_path / "doc.safetensors"
    path.write_bytes(saved[0].read_bytes())
    before = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("shadowkv_cache.prefix.format.save_file", crash)
    doc = ShadowKVCache.prefill(tiny_model("llama"), document, **small_budget_overrides(rank=4))
    with pytest.raises(OSError, match="disk full"):
        doc.save_prefix(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["doc.safetensors"]


def test_the_file_holds_no_pickle_and_documents_itself(saved):
    path, _ = saved
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        names = set(f.keys())
    assert meta["format"] == "shadowkv-prefix" and meta["version"] == FORMAT_VERSION
    assert meta["prefix_length"] == DOC and meta["kv_dtype"] == "float32"
    assert "model.layers.1.mlp.down_proj.weight" in meta["model"]["weights"]  # every weight that shapes K/V
    assert "lm_head.weight" not in meta["model"]["weights"]
    assert meta["policy"]["name"] == "LandmarkTopK" and "landmarks" in meta["policy"]["state"]
    assert {"token_ids", "layers.0.a", "layers.1.host_values", "layers.1.policy.landmarks"} <= names
    assert b"\x80\x04" not in path.read_bytes()[:64]  # safetensors, not a pickle


def test_save_to_a_directory_or_a_missing_folder_says_so(tmp_path, saved):
    _, doc = saved
    with pytest.raises(PrefixCacheError, match="is a directory"):
        doc.save_prefix(tmp_path)
    with pytest.raises(PrefixCacheError, match="folder that does not exist"):
        doc.save_prefix(tmp_path / "missing" / "doc.safetensors")
    assert list(tmp_path.iterdir()) == []
