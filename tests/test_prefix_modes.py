"""Prefix reuse beyond ShadowKV on plain models (docs/prefix_format.md, version 5): models with sliding-window layers
(the tiny Gemma 3: sliding and full-attention layers alternate, a 16-token window) and YAKV mode (the tiny Llama).

The reference for a loaded, forked or joined prefix is the cache it came from, continued in the same way; at full
budget Gemma 3 also equals the model's own `DynamicCache`, and YAKV equals a `DynamicCache` whose prompt went through
YAKV's 4-bit round trip (its one loss, tests/test_yakv.py).

Legend: S document tokens, Q question tokens, W a sliding layer's window.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    GEMMA3,
    HEAD_DIM,
    SLIDING_WINDOW,
    assert_logits_close,
    dynamic_cache,
    forward_with,
    full_budget_overrides,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)
from safetensors import safe_open
from safetensors.torch import save_file

from shadowkv_cache import PrefixCacheError, ShadowKVCache, unpatch_model
from shadowkv_cache.hf.adapters import _ADAPTERS
from shadowkv_cache.hf.microbatch import position_ids
from shadowkv_cache.hf.sliding_layer import SlidingLayer
from shadowkv_cache.policies import QuantizedKeyTopK, ResidualLandmarkTopK, SharedBudgetTopK
from shadowkv_cache.prefix import METADATA_KEY, batch_questions
from shadowkv_cache.quant import HiggsQuantizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DOC = 240  # past min_compress_len (64) and far past the sliding window (16)
NEW_TOKENS = 8
RECENT = 64  # YAKV's default recent window: the last 64 document tokens stay exact


def yakv(**changes) -> dict:
    """YAKV from 64 tokens on with a real selection (24 of the 176 quantised tokens per KV head)."""
    return {"mode": "yakv", "sparse_budget": 24, "min_compress_len": 64, **changes}


# Each kind of prefix: (model arch, cache options); the files are made once per module.
KINDS = {
    "gemma3": (GEMMA3, small_budget_overrides()),
    "yakv": ("llama", yakv()),
    "gemma3 yakv": (GEMMA3, yakv()),  # both: sliding layers beside quantised ones
}


@pytest.fixture(scope="module")
def document():
    return random_prompt(DOC, seed=700)[0]


@pytest.fixture(scope="module")
def question():
    return random_prompt(6, seed=701)[0]


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory, document):
    """`prefixes(kind)`: (path, the cache it was saved from) of a prefix file of that kind, made once."""
    made = {}

    def get(kind: str):
        if kind not in made:
            arch, options = KINDS[kind]
            path = tmp_path_factory.mktemp("prefix") / f"{kind}.safetensors"
            doc = ShadowKVCache.prefill(tiny_model(arch), document, **options)
            doc.save_prefix(path)
            made[kind] = path, doc
        return made[kind]

    return get


@pytest.fixture
def fresh_model(kind):
    """A model with the weights of the `kind` prefix's model, not yet patched."""
    model = make_tiny_model(KINDS[kind][0])
    yield model
    unpatch_model(model)


def ask(model, cache, document, question, **kwargs):
    return generate_with(model, torch.cat([document, question])[None], cache, max_new_tokens=NEW_TOKENS, **kwargs)


def rewrite(src, dst, edit_meta=None, edit_tensors=None):
    """A valid safetensors copy of `src` with its prefix metadata and/or tensors edited (digests not resealed)."""
    with safe_open(src, framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst, metadata={METADATA_KEY: json.dumps(meta)})
    return dst


# -- a loaded prefix is the prefix it was saved from -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_prefix_generates_what_the_original_does(prefixes, kind, document, question):
    path, doc = prefixes(kind)
    model = tiny_model(KINDS[kind][0])
    loaded = ShadowKVCache.load_prefix(model, path)
    assert loaded.config == doc.config and loaded.get_seq_length() == DOC
    for got, want in zip(loaded.layers, doc.layers):
        assert type(got) is type(want) and got.get_seq_length() == want.get_seq_length() == DOC
        if isinstance(want, SlidingLayer):  # the window itself: the last W - 1 tokens' keys and values
            assert got.keys.shape[2] == SLIDING_WINDOW - 1
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        else:
            assert got.is_compressed and got.mode.name == want.mode.name
    original = ask(model, doc.fork(), document, question)
    again = ask(model, loaded, document, question)
    assert torch.equal(again.sequences, original.sequences)
    assert_logits_close(again.logits, original.logits, rtol=0, atol=0)  # the very same tensors


def test_gemma3_full_budget_prefix_matches_dynamic_cache(tmp_path, document, question):
    model = tiny_model(GEMMA3)
    ShadowKVCache.prefill(model, document, **full_budget_overrides()).save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    out = ask(model, loaded, document, question)
    ref = ask(model, dynamic_cache(model), document, question)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
    assert loaded.memory_report().hit_rate is not None  # the full-attention layers selected and rebuilt


@torch.no_grad()
def yakv_reference(model, document, question, steps: int):
    """Greedy decoding with `DynamicCache` after the document, whose keys and values (all but the last `RECENT`)
    went through YAKV's 4-bit round trip, then the question: (tokens `[1, steps]`, per-step logits `[1, V]`)."""
    cache = dynamic_cache(model)
    forward_with(model, document[None], cache)
    quantizer = HiggsQuantizer(HEAD_DIM, 2)
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            part = tensor[:, :, : DOC - RECENT]
            part.copy_(quantizer.dequantize(quantizer.quantize(part), tensor.dtype))
    out = forward_with(model, question[None], cache)
    logits, tokens = [out.logits[:, -1]], [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(steps - 1):
        out = forward_with(model, tokens[-1], cache)
        logits.append(out.logits[:, -1])
        tokens.append(logits[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), logits


def test_yakv_full_budget_prefix_matches_the_quantised_dynamic_cache(tmp_path, document, question):
    model = tiny_model("llama")
    ShadowKVCache.prefill(model, document, **yakv(sparse_budget=10**6)).save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    assert all(layer.mode.name == "yakv" and layer.is_compressed for layer in loaded.layers)
    out = ask(model, loaded, document, question)
    tokens, logits = yakv_reference(model, document, question, NEW_TOKENS)
    assert torch.equal(out.sequences[:, -NEW_TOKENS:], tokens)
    assert_logits_close(out.logits, logits, rtol=1e-4, atol=1e-4)
    assert sum(layer.mode.sparse_steps for layer in loaded.layers) > 0  # single-token steps selected tokens


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("length", [10, 40])  # shorter than the sliding window, and than min_compress_len
def test_a_short_document_round_trips(tmp_path, kind, length, question):
    arch, options = KINDS[kind]
    model = tiny_model(arch)
    short = random_prompt(length, seed=702)[0]
    doc = ShadowKVCache.prefill(model, short, **options)
    assert not any(layer.is_compressed for layer in doc.layers)
    doc.save_prefix(tmp_path / "short.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "short.safetensors")
    out = ask(model, loaded, short, question)
    ref = ask(model, dynamic_cache(model), short, question)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


def test_a_prefix_saved_from_a_plain_forward_loads(tmp_path, document, question):
    """`save_prefix(path, input_ids=...)` after `model(ids, past_key_values=cache)`, with sliding layers."""
    model = tiny_model(GEMMA3)
    cache = ShadowKVCache(model, **small_budget_overrides())
    forward_with(model, document[None], cache)
    cache.save_prefix(tmp_path / "doc.safetensors", input_ids=document)
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    assert torch.equal(
        ask(model, loaded, document, question).sequences, ask(model, cache, document, question).sequences
    )


# -- one document, many questions ------------------------------------------------------------------------------


def test_yakv_shared_batch_gives_each_question_what_it_gets_alone(document):
    """`[document][left-padded question]` over a YAKV document: pads are neither attended nor scored."""
    model = tiny_model("llama")
    questions = [random_prompt(n, seed=710 + n)[0] for n in (7, 2, 12)]
    doc = ShadowKVCache.prefill(model, document, **yakv())
    ids, mask = batch_questions(doc.prefix_ids, questions, pad_token_id=0)
    shared = doc.fork(batch_size=3)
    assert shared.layers[0].prompt.store.data is doc.layers[0].prompt.store.data  # one host copy
    assert shared.layers[0].prompt.policy_state["codes"].stride(0) == 0  # device: views of one copy
    batch = generate_with(model, ids, shared, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for i, q in enumerate(questions):
        alone = ask(model, doc.fork(), document, q)
        assert torch.equal(batch.sequences[i, -NEW_TOKENS:], alone.sequences[0, -NEW_TOKENS:]), f"question {i}"
        assert_logits_close([step[i : i + 1] for step in batch.logits], alone.logits)


def test_gemma3_forked_rows_share_the_windows_and_answer_as_alone(document):
    """Questions of one length need no pads: each row of a fork answers as its question alone, and the forked
    sliding layers are views of the document's window until their rows add tokens."""
    model = tiny_model(GEMMA3)
    questions = [random_prompt(6, seed=720 + i)[0] for i in range(3)]
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    shared = doc.fork(3)
    for got, want in zip(shared.layers, doc.layers):
        if isinstance(want, SlidingLayer):
            assert got.keys.shape[0] == 3 and got.keys.stride(0) == 0 and got.keys.data_ptr() == want.keys.data_ptr()
            assert got.cumulative_length == DOC
            assert got.nbytes()[0] == want.nbytes()[0] and got.nbytes()[2] == 3 * want.nbytes()[2]  # held once
    ids, mask = batch_questions(doc.prefix_ids, questions, pad_token_id=0)
    assert bool(mask.all())
    batch = generate_with(model, ids, shared, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for i, q in enumerate(questions):
        alone = ask(model, doc.fork(), document, q)
        assert torch.equal(batch.sequences[i, -NEW_TOKENS:], alone.sequences[0, -NEW_TOKENS:]), f"question {i}"
        assert_logits_close([step[i : i + 1] for step in batch.logits], alone.logits)
    # The document is untouched: a later fork answers the same again.
    assert all(layer.get_seq_length() == DOC for layer in doc.layers)
    first = ask(model, doc.fork(), document, questions[0])
    assert torch.equal(first.sequences[0, -NEW_TOKENS:], batch.sequences[0, -NEW_TOKENS:])


def test_gemma3_padded_questions_are_refused_before_the_model_runs(document):
    """Sliding windows count slots, pads included: pads between the document and a question would change what the
    question sees, so a batch of questions of different lengths is refused."""
    model = tiny_model(GEMMA3)
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides())
    ids, mask = batch_questions(doc.prefix_ids, [random_prompt(n, seed=730 + n)[0] for n in (3, 5)], pad_token_id=0)
    shared = doc.fork(2)
    with pytest.raises(PrefixCacheError, match="sliding-window layers, whose window counts pads"):
        generate_with(model, ids, shared, attention_mask=mask, max_new_tokens=2)
    assert all(layer.get_seq_length() == DOC for layer in shared.layers)  # nothing ran


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_batch_of_two_prompts_equals_each_alone(kind):
    """Micro batches of one row, joined (sliding windows row by row, YAKV prompts padded to one width): each row
    of the joined cache decodes as its prompt does alone, prefilled but its last token as `prefill_batch` does."""
    arch, options = KINDS[kind]
    model = tiny_model(arch)
    rows = [random_prompt(n, seed=740 + n)[0] for n in (260, 190)]
    ids, mask = left_pad(rows)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **options)
    assert all(layer.is_compressed for layer in cache.layers if not isinstance(layer, SlidingLayer))
    together = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for i, row in enumerate(rows):
        alone = generate_with(model, row[None], ShadowKVCache.prefill(model, row[:-1], **options), NEW_TOKENS)
        assert torch.equal(together.sequences[i, -NEW_TOKENS:], alone.sequences[0, -NEW_TOKENS:]), f"row {i}"
        assert_logits_close([step[i : i + 1] for step in together.logits], alone.logits, rtol=1e-4, atol=1e-4)


def test_yakv_prefill_batch_holds_exact_rows_beside_quantised_ones():
    """A micro batch whose rows are all shorter than `min_compress_len` stays exact until the join puts its rows in
    the recent window, as a batched prefill holds them; it then decodes as that batched prefill does."""
    model = tiny_model("qwen2")
    ids, mask = left_pad([random_prompt(n, seed=750 + n)[0] for n in (40, 300, 50)])
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=2, **yakv())
    prompt = cache.layers[0].prompt
    assert prompt.budget_tokens.tolist() == [0, 24, 0] and not prompt.real[[0, 2]].any()
    assert prompt.local_valid.sum(-1).tolist() == [39, RECENT, 49]  # prefill_batch holds back each last token
    ref_cache = ShadowKVCache(model, **yakv())  # the reference: the batch but its last token in one forward
    head = mask[:, :-1]
    forward_with(model, ids[:, :-1], ref_cache, attention_mask=head, position_ids=position_ids(head))
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        got, want = layer.prompt, ref_layer.prompt
        for name in ("real", "budget_tokens", "local_valid", "local_keys", "local_values"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(got.store.data, want.store.data)
    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, ref_cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)


# -- files that do not fit --------------------------------------------------------------------------------------


OTHER_CONFIG = {  # per arch, one layer more (Gemma 3: one more sliding layer)
    GEMMA3: {
        "num_hidden_layers": 5,
        "layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
    },
    "llama": {"num_hidden_layers": 3},
}


@pytest.mark.parametrize("kind", KINDS)
def test_another_model_is_refused_before_anything_changes(prefixes, kind):
    path, _ = prefixes(kind)
    other = make_tiny_model(KINDS[kind][0], seed=99)
    with pytest.raises(PrefixCacheError, match="same config but other weights"):
        ShadowKVCache.load_prefix(other, path)
    deeper = make_tiny_model(KINDS[kind][0], **OTHER_CONFIG[KINDS[kind][0]])
    with pytest.raises(PrefixCacheError, match="config differs: .*num_hidden_layers"):
        ShadowKVCache.load_prefix(deeper, path)
    assert other not in _ADAPTERS and deeper not in _ADAPTERS  # not even patched


@pytest.mark.parametrize("kind", ["yakv"])
def test_another_mode_is_refused(prefixes, kind, fresh_model):
    path, _ = prefixes(kind)
    with pytest.raises(PrefixCacheError, match="mode: 'yakv' in the file, 'shadowkv' here"):
        ShadowKVCache.load_prefix(fresh_model, path, mode="shadowkv")
    assert fresh_model not in _ADAPTERS


@pytest.mark.parametrize("kind", ["gemma3"])
def test_yakv_mode_for_a_shadowkv_file_is_refused(prefixes, kind, fresh_model):
    """ShadowKV's options (rank, outliers) have no meaning in YAKV mode: the config asked for is refused as such."""
    path, _ = prefixes(kind)
    with pytest.raises(PrefixCacheError, match="invalid option.*no low-rank"):
        ShadowKVCache.load_prefix(fresh_model, path, mode="yakv")
    assert fresh_model not in _ADAPTERS


@pytest.mark.parametrize("kind", ["yakv"])
def test_yakv_scoring_policy_of_other_settings_is_refused(prefixes, kind, fresh_model):
    path, _ = prefixes(kind)
    with pytest.raises(PrefixCacheError, match="other settings: seed: 0 in the file, 1 here"):
        ShadowKVCache.load_prefix(fresh_model, path, policy=QuantizedKeyTopK(seed=1))
    assert fresh_model not in _ADAPTERS


@pytest.mark.parametrize(
    "policy, other",
    [
        (lambda: ResidualLandmarkTopK(), lambda: ResidualLandmarkTopK(group_size=4)),
        (lambda: SharedBudgetTopK(ResidualLandmarkTopK()), lambda: SharedBudgetTopK(ResidualLandmarkTopK(seed=2))),
    ],
    ids=["residual landmarks", "shared budget"],
)
def test_yakv_extension_policies_round_trip_and_their_settings_are_checked(tmp_path, document, question, policy, other):
    """The study's two extensions (docs/yakv.md) save their own state; a load needs the same policy, wrapped ones
    included, and by default (the mode's own policy) names the one the file needs."""
    model = tiny_model("llama")
    doc = ShadowKVCache.prefill(model, document, policy=policy(), **yakv())
    doc.save_prefix(tmp_path / "doc.safetensors")
    with pytest.raises(PrefixCacheError, match=f"pass policy={type(policy()).__name__}"):
        ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    with pytest.raises(PrefixCacheError, match="with other settings"):
        ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors", policy=other())
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors", policy=policy())
    original, again = ask(model, doc.fork(), document, question), ask(model, loaded, document, question)
    assert torch.equal(again.sequences, original.sequences)
    assert_logits_close(again.logits, original.logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["yakv"])
def test_a_changed_quantiser_grid_is_refused(prefixes, kind, fresh_model, tmp_path):
    path, _ = prefixes(kind)

    def other_grid(meta):
        meta["quantizers"]["host"]["grid"][0] += 0.01

    tampered = rewrite(path, tmp_path / "grid.safetensors", edit_meta=other_grid)
    with pytest.raises(PrefixCacheError, match="host codes of the HIGGS quantiser"):
        ShadowKVCache.load_prefix(fresh_model, tampered)
    assert fresh_model not in _ADAPTERS


def _flip_first(name_part: str):
    def edit(tensors):
        name = next(n for n in sorted(tensors) if name_part in n)
        tensors[name].view(torch.uint8).view(-1)[0] ^= 1

    return edit


@pytest.mark.parametrize(
    "kind, part",
    [("yakv", "host_records"), ("yakv", "policy.codes"), ("yakv", "local_values"), ("gemma3", "layers.0.keys")],
)
def test_a_tampered_tensor_is_found(prefixes, kind, fresh_model, tmp_path, part):
    path, _ = prefixes(kind)
    tampered = rewrite(path, tmp_path / "flipped.safetensors", edit_tensors=_flip_first(part))
    with pytest.raises(PrefixCacheError, match="does not match its digest"):
        ShadowKVCache.load_prefix(fresh_model, tampered)
    assert fresh_model not in _ADAPTERS


STRUCTURE = {  # (the kind of prefix that holds the tensor, the edit, the error)
    "sliding window shape": (
        "gemma3",
        lambda t: t.update({"layers.0.keys": t["layers.0.keys"][:, :, 1:].contiguous()}),
        "layers.0.keys is",
    ),
    "yakv real mask": ("yakv", lambda t: t["layers.1.real"].zero_(), "positions and masks"),
    "yakv budget": ("yakv", lambda t: t["layers.0.budget_tokens"].add_(1), "positions and masks"),
    "yakv record size": (
        "yakv",
        lambda t: t.update({"layers.1.host_records": t["layers.1.host_records"][..., :-2].contiguous()}),
        "host_records is",
    ),
}


@pytest.mark.parametrize("kind, case", [(kind, case) for case, (kind, _, _) in STRUCTURE.items()])
def test_structure_that_does_not_fit_is_named(prefixes, kind, fresh_model, tmp_path, case):
    path, _ = prefixes(kind)
    _, edit, message = STRUCTURE[case]
    tampered = rewrite(path, tmp_path / "shape.safetensors", edit_tensors=edit)
    with pytest.raises(PrefixCacheError, match=message):
        ShadowKVCache.load_prefix(fresh_model, tampered)
    assert fresh_model not in _ADAPTERS


@pytest.mark.parametrize("kind", KINDS)
def test_a_signed_prefix_needs_its_key(prefixes, kind, fresh_model, document, tmp_path):
    _, doc = prefixes(kind)
    doc.save_prefix(tmp_path / "signed.safetensors", key=b"secret")
    with pytest.raises(PrefixCacheError, match="signed with a key"):
        ShadowKVCache.load_prefix(fresh_model, tmp_path / "signed.safetensors")
    with pytest.raises(PrefixCacheError, match="HMAC does not match"):
        ShadowKVCache.load_prefix(fresh_model, tmp_path / "signed.safetensors", key=b"other")
    loaded = ShadowKVCache.load_prefix(fresh_model, tmp_path / "signed.safetensors", key=b"secret")
    assert torch.equal(loaded.prefix_ids, document)


@pytest.mark.parametrize("kind", KINDS)
def test_a_version_4_file_is_refused_naming_its_version(prefixes, kind, fresh_model, tmp_path):
    path, _ = prefixes(kind)
    old = rewrite(path, tmp_path / "v4.safetensors", edit_meta=lambda m: m.update(version=4))
    with pytest.raises(PrefixCacheError, match="version 4 predates sliding-window layers, YAKV mode.*reads version 5"):
        ShadowKVCache.load_prefix(fresh_model, old)
    assert fresh_model not in _ADAPTERS


@pytest.mark.parametrize("kind", KINDS)
def test_save_needs_a_cache_that_holds_only_the_document(prefixes, kind, tmp_path, document, question):
    _, doc = prefixes(kind)
    used = doc.fork()
    ask(tiny_model(KINDS[kind][0]), used, document, question)
    with pytest.raises(PrefixCacheError, match="holds exactly the 240-token document"):
        used.save_prefix(tmp_path / "used.safetensors")
    assert not (tmp_path / "used.safetensors").exists()
