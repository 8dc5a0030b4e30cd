"""YAKV mode (design.md §4): quantised keys and values on the host, every token scored from a ~2-bit device copy.

At full budget a YAKV cache must reproduce the model's own `DynamicCache` whose prompt keys and values
(all but the recent window) went through the same 4-bit quantise-dequantise round trip; below it, padded
rows, multi-turn and row operations behave as in ShadowKV mode.

Legend: B batch, S prompt tokens, Hkv KV heads, D head dim, N quantised tokens, W recent window.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHS,
    HEAD_DIM,
    NUM_KV_HEADS,
    assert_logits_close,
    dynamic_cache,
    forward_with,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    tiny_model,
)

from shadowkv_cache import LandmarkTopK, ShadowKVCache, ShadowKVConfig
from shadowkv_cache.hf.layer import CompressedLayer
from shadowkv_cache.ops.gather_dequant import gather_dequant
from shadowkv_cache.ops.score_codes import score_codes
from shadowkv_cache.policies import QuantizedKeyTopK
from shadowkv_cache.quant import HiggsQuantizer, QuantizedVectors
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, pack_records
from shadowkv_cache.yakv.mode import YakvMode

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPT = 300
RECENT = 64
STEPS = 12


def yakv(**changes) -> dict:
    """Compression from 64 tokens on, the default recent window (64), a budget that covers everything."""
    return {"mode": "yakv", "sparse_budget": 10**6, "min_compress_len": 64, **changes}


def small_yakv(**changes) -> dict:
    """A real selection: 24 of the ~236 quantised tokens per KV head."""
    return yakv(sparse_budget=24, **changes)


@torch.no_grad()
def quantised_reference(model, ids: torch.Tensor, steps: int, recent: int = RECENT):
    """Greedy decoding with `DynamicCache` after replacing each layer's prompt keys and values, except the last
    `recent` tokens, by their 4-bit round trip. Returns (tokens `[1, steps]`, per-step logits `[1, V]`)."""
    cache = dynamic_cache(model)
    out = forward_with(model, ids, cache)
    quantizer = HiggsQuantizer(HEAD_DIM, 2)
    quantised = ids.shape[1] - recent
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            part = tensor[:, :, :quantised]
            part.copy_(quantizer.dequantize(quantizer.quantize(part), tensor.dtype))
    logits = [out.logits[:, -1]]
    tokens = [logits[-1].argmax(-1, keepdim=True)]
    for _ in range(steps - 1):
        out = forward_with(model, tokens[-1], cache)
        logits.append(out.logits[:, -1])
        tokens.append(logits[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), logits


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_full_budget_matches_dynamic_cache_on_quantised_prompt(model):
    ids = random_prompt(PROMPT, seed=5)
    cache = ShadowKVCache(model, **yakv())
    out = generate_with(model, ids, cache, max_new_tokens=STEPS)
    ref_tokens, ref_logits = quantised_reference(model, ids, STEPS)

    assert torch.equal(out.sequences[:, PROMPT:], ref_tokens)
    assert_logits_close(out.logits, ref_logits)
    for layer in cache.layers:
        assert isinstance(layer, CompressedLayer) and isinstance(layer.mode, YakvMode) and layer.is_compressed
        assert layer.prompt.real.sum() == PROMPT - RECENT
        assert layer.mode.sparse_steps == STEPS - 1  # every decode step selected (the first logits are the prefill's)
        # Every token is selected at every step: the first sparse step fetches them all, later ones hold them.
        selected = (PROMPT - RECENT) * NUM_KV_HEADS
        record = 2 * HEAD_DIM // 2 + 4
        assert layer.mode.fetched_bytes == selected * record
        assert layer.mode.hit_counts() == ((STEPS - 2) * selected, (STEPS - 1) * selected)


def test_quantisation_changes_the_output():
    """The reference above is not DynamicCache in disguise: 4-bit keys and values move the logits."""
    model = tiny_model("llama")
    ids = random_prompt(PROMPT, seed=5)
    out = generate_with(model, ids, ShadowKVCache(model, **yakv()), max_new_tokens=4)
    exact = generate_with(model, ids, dynamic_cache(model), max_new_tokens=4)
    assert (out.logits[1] - exact.logits[1]).abs().max() > 1e-3


def test_default_budget_and_recent_window_resolve_in_tokens():
    config = ShadowKVConfig(mode="yakv", min_compress_len=1024)
    sizes = config.resolve(65536, 1024)
    assert (sizes.local, sizes.num_chunks, sizes.budget_chunks) == (64, 65536 - 64, 2048)  # 3.125%
    assert config.resolve(2048, 1024).budget_chunks == 512  # the floor
    assert config.resolve(1000, 1024).num_chunks == 0  # shorter than min_compress_len: exact
    assert ShadowKVConfig(mode="yakv", sparse_budget=0.1, recent_window=8).resolve(4108, 1024).budget_chunks == 411


def test_selection_is_the_top_tokens_of_the_scoring_copy(llama):
    """At a small budget the tokens attended are exactly the policy's top-k of the 2-bit scores."""
    ids = random_prompt(PROMPT, seed=6)
    cache = ShadowKVCache(llama, **small_yakv())
    forward_with(llama, ids, cache)
    layer = cache.layers[0]
    prompt = layer.prompt
    query = torch.randn(1, 4, 1, HEAD_DIM)
    ids_sel = cache.policy.select(query, prompt.policy_state, prompt.selectable, 24, 0.25)
    scores = cache.policy.score(query, prompt.policy_state, prompt.selectable, 0.25)
    assert torch.equal(ids_sel.sort(-1).values, scores.topk(24, dim=-1).indices.sort(-1).values)
    assert ids_sel.max() < PROMPT - RECENT


def test_padded_rows_match_rows_alone(llama):
    rows = [random_prompt(PROMPT, seed=10)[0], random_prompt(200, seed=11)[0], random_prompt(50, seed=12)[0]]
    ids, mask = left_pad(rows)
    together = generate_with(llama, ids, ShadowKVCache(llama, **small_yakv()), attention_mask=mask)
    for row, prompt in enumerate(rows):
        alone = generate_with(llama, prompt[None], ShadowKVCache(llama, **small_yakv()))
        assert torch.equal(together.sequences[row, ids.shape[1] :], alone.sequences[0, len(prompt) :])
        assert_logits_close([step[row : row + 1] for step in together.logits], alone.logits)


def test_pads_are_never_scored_nor_quantised(llama):
    rows = [random_prompt(PROMPT, seed=13)[0], random_prompt(150, seed=14)[0]]
    ids, mask = left_pad(rows)
    cache = ShadowKVCache(llama, **small_yakv())
    forward_with(llama, ids, cache, attention_mask=mask)
    prompt = cache.layers[0].prompt
    assert prompt.real.sum(-1).tolist() == [PROMPT - RECENT, 150 - RECENT]
    assert prompt.local_valid.sum(-1).tolist() == [RECENT, RECENT]
    scores = cache.policy.score(torch.randn(2, 4, 1, HEAD_DIM), prompt.policy_state, prompt.selectable, 0.25)
    assert (scores[1, :, 150 - RECENT :] == 0).all()  # a masked slot gets no probability


def test_multi_turn_reads_every_token_and_matches_the_reference(llama):
    """A second turn (a multi-token step) reads the whole quantised prompt, so at any budget its first logits
    equal DynamicCache on the quantised prompt; the turn's decode steps are sparse again."""
    ids = random_prompt(PROMPT, seed=20)
    turn = random_prompt(5, seed=21)
    cache = ShadowKVCache(llama, **small_yakv())
    first = generate_with(llama, ids, cache, max_new_tokens=1)  # prefill only: no sparse step yet
    seq = torch.cat([first.sequences, turn], dim=1)
    second = generate_with(llama, seq, cache, max_new_tokens=4)
    assert cache.get_seq_length() == seq.shape[1] + 3

    ref = dynamic_cache(llama)
    forward_with(llama, ids, ref)
    quantizer = HiggsQuantizer(HEAD_DIM, 2)
    for layer in ref.layers:
        for tensor in (layer.keys, layer.values):
            part = tensor[:, :, : PROMPT - RECENT]
            part.copy_(quantizer.dequantize(quantizer.quantize(part), tensor.dtype))
    ref_logits = forward_with(llama, seq[:, PROMPT:], ref).logits[:, -1]
    torch.testing.assert_close(second.logits[0], ref_logits, rtol=1e-4, atol=1e-5)
    layer = cache.layers[0]
    assert layer.mode.sparse_steps == 3
    record = 2 * HEAD_DIM // 2 + 4
    dense = (PROMPT - RECENT) * NUM_KV_HEADS * record
    hits, lookups = layer.mode.hit_counts()
    assert lookups == 3 * 24 * NUM_KV_HEADS and 0 <= hits <= 2 * 24 * NUM_KV_HEADS  # the first sparse step holds none
    assert layer.mode.fetched_bytes == dense + (lookups - hits) * record


def test_crop_then_next_turn_equals_fresh_turn(llama):
    ids = random_prompt(PROMPT, seed=22)
    turn = random_prompt(4, seed=23)
    cache = ShadowKVCache(llama, **small_yakv())
    generate_with(llama, ids, cache, max_new_tokens=5)
    cache.crop(PROMPT)  # drop the generated tokens, as the accuracy suite does between turns
    assert cache.get_seq_length() == PROMPT
    again = generate_with(llama, torch.cat([ids, turn], dim=1), cache, max_new_tokens=4)

    fresh = ShadowKVCache(llama, **small_yakv())
    forward_with(llama, ids, fresh)
    alone = generate_with(llama, torch.cat([ids, turn], dim=1), fresh, max_new_tokens=4)
    assert torch.equal(again.sequences, alone.sequences)
    assert_logits_close(again.logits, alone.logits)
    with pytest.raises(NotImplementedError, match="compressed"):
        cache.crop(PROMPT - 10)


def test_reorder_select_and_repeat_rows(llama):
    rows = [random_prompt(PROMPT, seed=30)[0], random_prompt(260, seed=31)[0]]
    ids, mask = left_pad(rows)
    straight, swapped = ShadowKVCache(llama, **small_yakv()), ShadowKVCache(llama, **small_yakv())
    first = generate_with(llama, ids, straight, attention_mask=mask, max_new_tokens=3)
    generate_with(llama, ids, swapped, attention_mask=mask, max_new_tokens=3)
    swapped.reorder_cache(torch.tensor([1, 0]))
    turn = random_prompt(2, batch=2, seed=32)
    seq = torch.cat([first.sequences, turn], dim=1)
    mask = torch.cat([mask, torch.ones((2, seq.shape[1] - mask.shape[1]), dtype=torch.long)], dim=1)
    a = generate_with(llama, seq, straight, attention_mask=mask, max_new_tokens=5)
    b = generate_with(llama, seq.flip(0), swapped, attention_mask=mask.flip(0), max_new_tokens=5)
    assert torch.equal(a.sequences, b.sequences.flip(0))
    assert_logits_close([step.flip(0) for step in b.logits], a.logits)

    # Keep row 0 only, then repeat it: the rows share the host records and decode alike.
    straight.batch_select_indices(torch.tensor([0]))
    straight.batch_repeat_interleave(2)
    prompt = straight.layers[0].prompt
    assert prompt.store.data.shape[0] == 2 and prompt.store.row_map.tolist() == [0, 0]
    seq0 = torch.cat([a.sequences[:1], random_prompt(2, seed=33)], dim=1)
    both = generate_with(llama, seq0.expand(2, -1), straight, max_new_tokens=4)
    assert torch.equal(both.sequences[0], both.sequences[1])


def test_fork_shares_one_document(llama):
    """Three questions over one prefilled document: one device copy and one host copy, and each row decodes
    as a cache that prefilled the document alone (the question is a dense multi-token step in both)."""
    ids = random_prompt(PROMPT, seed=40)
    forked = ShadowKVCache.prefill(llama, ids, **small_yakv()).fork(3)
    prompt = forked.layers[0].prompt
    assert prompt.real.stride(0) == 0 and prompt.store.data.shape[0] == 1
    seq = torch.cat([ids, random_prompt(3, seed=41)], dim=1)
    out = generate_with(llama, seq.expand(3, -1), forked, max_new_tokens=4)
    alone = generate_with(llama, seq, ShadowKVCache.prefill(llama, ids, **small_yakv()), max_new_tokens=4)
    for row in range(3):
        assert torch.equal(out.sequences[row], alone.sequences[0])
        assert_logits_close([step[row : row + 1] for step in out.logits], alone.logits)
    single = ShadowKVCache.prefill(llama, ids, **small_yakv()).memory_report()
    assert forked.memory_report().host_bytes == single.host_bytes


def test_memory_report_counts_device_and_host_bytes(llama):
    ids = random_prompt(PROMPT, seed=50)
    cache = ShadowKVCache(llama, **small_yakv())
    generate_with(llama, ids, cache, max_new_tokens=4)
    report = cache.memory_report()
    generated = 3  # the last generated token is never fed back
    quantised = PROMPT - RECENT
    score_bytes = quantised * NUM_KV_HEADS * (HEAD_DIM // 4 + 2)  # 2-bit codes + fp16 norm
    # fp32 K and V of the recent window, and the buffer of tokens after the prompt (its capacity, 256 slots, is held
    # whatever `generated`, with one validity byte per slot)
    capacity = 256
    exact = 2 * NUM_KV_HEADS * (RECENT + capacity) * HEAD_DIM * 4 + capacity
    # The held tokens: 24 slots per KV head (the budget), an int64 id and fp32 key and value each
    held = 24 * NUM_KV_HEADS * (8 + 2 * HEAD_DIM * 4)
    device = score_bytes + exact + quantised + RECENT + 8 + held  # + real-token and recent-window masks + budget
    host = quantised * NUM_KV_HEADS * (2 * HEAD_DIM // 2 + 4)
    assert [m.gpu_bytes for m in report.layers] == [device, device]
    assert [m.host_bytes for m in report.layers] == [host, host]
    full = 2 * NUM_KV_HEADS * (PROMPT + generated) * HEAD_DIM * 4
    assert report.dynamic_cache_bytes == 2 * full
    counts = [layer.hit_counts() for layer in cache.layers]
    assert report.hit_rate == sum(h for h, _ in counts) / sum(n for _, n in counts)
    assert all(n == generated * 24 * NUM_KV_HEADS for _, n in counts)  # the 3 single-token steps selected


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"mode": "fast"}, "mode"),
        ({"mode": "yakv", "host_grid_dim": 3}, "host_grid_dim"),
        ({"mode": "yakv", "score_grid_dim": 16}, "score_grid_dim"),
        ({"mode": "yakv", "recent_window": -1}, "recent_window"),
        ({"mode": "yakv", "recent_window": 1.5}, "recent_window"),
        ({"mode": "yakv", "rank": 8}, "no low-rank"),
        ({"mode": "yakv", "outlier_chunks": 2}, "no low-rank"),
        ({"mode": "yakv", "sparse_budget": 0}, "sparse_budget"),
    ],
)
def test_bad_config_raises(changes, match):
    with pytest.raises(ValueError, match=match):
        ShadowKVConfig(**changes)


def test_bad_model_or_policy_raises_before_patching(llama):
    odd = make_tiny_model("llama", head_dim=24)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ShadowKVCache(odd, mode="yakv")
    ShadowKVCache(odd)  # ShadowKV mode still accepts it
    with pytest.raises(ValueError, match="selects by token"):
        ShadowKVCache(llama, mode="yakv", policy=LandmarkTopK())
    with pytest.raises(ValueError, match="selects by chunk"):
        ShadowKVCache(llama, policy=QuantizedKeyTopK())


def test_prefix_files_hold_yakv(llama, tmp_path):
    """Once refused; now a YAKV document round-trips as it is held: the host records, the scoring codes and the
    recent window (tests/test_prefix_modes.py covers generation from it and the refusals)."""
    doc = ShadowKVCache.prefill(llama, random_prompt(100, seed=60), **small_yakv())
    doc.save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(llama, tmp_path / "doc.safetensors")
    assert loaded.config.mode == "yakv" and isinstance(loaded.policy, QuantizedKeyTopK)
    for got, want in zip(loaded.layers, doc.layers):
        assert torch.equal(got.prompt.store.data, want.prompt.store.data)
        for name in ("real", "local_keys", "local_values", "local_valid", "budget_tokens"):
            assert torch.equal(getattr(got.prompt, name), getattr(want.prompt, name)), name
        for name, state in want.prompt.policy_state.items():
            assert torch.equal(got.prompt.policy_state[name], state), name
        assert (got.prompt.slots, got.prompt.max_budget_tokens) == (want.prompt.slots, want.prompt.max_budget_tokens)


# -- the two hot ops against their definitions ------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_score_codes_op_equals_quantiser_scores(p, monkeypatch):
    quantizer = HiggsQuantizer(32, p)
    keys = torch.randn(2, 3, 70, 32)
    query = torch.randn(2, 3, 5, 32)  # [B, Hkv, Q, D]
    packed = quantizer.quantize(keys)
    table = quantizer.lookup_table(quantizer.rotate(query))
    expected = query @ quantizer.dequantize(packed, torch.float32).transpose(-1, -2)  # [B, Hkv, Q, N]
    torch.testing.assert_close(score_codes(table, packed.codes, packed.norms, 32), expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr("shadowkv_cache.ops.score_codes._BLOCK_ELEMENTS", 1000)  # several token blocks
    torch.testing.assert_close(score_codes(table, packed.codes, packed.norms, 32), expected, rtol=1e-4, atol=1e-4)


def test_gather_dequant_op_reads_the_right_records():
    quantizer = HiggsQuantizer(16, 2)
    keys, values = torch.randn(2, 3, 40, 16), torch.randn(2, 3, 40, 16)
    qk, qv = quantizer.quantize(keys), quantizer.quantize(values)
    store = QuantizedKVStore.offload(pack_records(qk, qv), pin=False).select_rows(torch.tensor([1, 0]))
    ids = torch.randint(0, 40, (2, 3, 7))
    got_k, got_v = gather_dequant(store, ids, quantizer, torch.float32)
    for b, stored in enumerate((1, 0)):
        for h in range(3):
            pick = QuantizedVectors(qk.codes[stored, h, ids[b, h]], qk.norms[stored, h, ids[b, h]])
            torch.testing.assert_close(got_k[b, h], quantizer.dequantize(pick, torch.float32))
            pick = QuantizedVectors(qv.codes[stored, h, ids[b, h]], qv.norms[stored, h, ids[b, h]])
            torch.testing.assert_close(got_v[b, h], quantizer.dequantize(pick, torch.float32))


# -- the real model ------------------------------------------------------------------------------------------

SMOL_PROMPT, SMOL_STEPS, SMOL_BUDGET = 2048, 48, 128
# Measured on CPU (fp32) at this setting: agreement 0.959 (47/49 steps), mean KL 0.045, 16/16 greedy tokens
# (ShadowKV mode at the default rank gives 0.796 / 0.120 at the same 128-token budget and 0.776 / 0.176 at 64
# tokens, its equal-PCIe-bytes point with bf16 values). The floors sit just under.
SMOL_FLOOR_AGREEMENT = 0.93
SMOL_CEIL_KL = 0.06


@pytest.mark.slow
def test_smollm2_fidelity_at_a_modest_budget(smollm2, smollm2_reference):
    """SmolLM2 (head dim 64, 3 KV heads) at 2K tokens, 128 tokens per KV head (~6% of the prompt)."""
    from shadowkv_cache.fidelity import measure_fidelity, natural_text_ids

    model, tokenizer = smollm2
    ids = natural_text_ids(tokenizer, SMOL_PROMPT + SMOL_STEPS)
    make = lambda: ShadowKVCache(model, mode="yakv", sparse_budget=SMOL_BUDGET, min_compress_len=1024)  # noqa: E731
    cache = make()
    forward_with(model, ids[:, :SMOL_PROMPT], cache)
    layer = cache.layers[0]
    assert layer.is_compressed and int(layer.prompt.real.sum()) == SMOL_PROMPT - RECENT
    assert layer.prompt.store.record_bytes == 2 * 64 // 2 + 4  # 4.25 bits per value at D = 64

    reference = smollm2_reference(ids, SMOL_PROMPT, 16)
    fid = measure_fidelity(model, ids, SMOL_PROMPT, make, greedy_tokens=16, reference=reference)
    print(f"SmolLM2 2K YAKV fidelity at {SMOL_BUDGET} tokens: {fid}")
    assert fid.agreement >= SMOL_FLOOR_AGREEMENT
    assert fid.mean_kl <= SMOL_CEIL_KL


# -- CUDA (pinned host records); run with `pytest -m gpu` on a CUDA machine ------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_yakv_on_cuda(arch):
    model = make_tiny_model(arch).cuda()
    ids = random_prompt(PROMPT, seed=5).cuda()
    cache = ShadowKVCache(model, **yakv())
    out = generate_with(model, ids, cache, max_new_tokens=STEPS)
    ref_tokens, ref_logits = quantised_reference(model, ids, STEPS)
    assert torch.equal(out.sequences[:, PROMPT:], ref_tokens)
    assert_logits_close(out.logits, ref_logits, atol=1e-4)  # CUDA SDPA sums in another order than the CPU
    for layer in cache.layers:
        assert layer.prompt.store.data.is_pinned() and layer.prompt.policy_state["codes"].is_cuda

    rows = [random_prompt(PROMPT, seed=10)[0], random_prompt(200, seed=11)[0]]
    padded, mask = left_pad(rows)
    together = generate_with(model, padded.cuda(), ShadowKVCache(model, **small_yakv()), attention_mask=mask.cuda())
    for row, prompt in enumerate(rows):
        alone = generate_with(model, prompt[None].cuda(), ShadowKVCache(model, **small_yakv()))
        assert torch.equal(together.sequences[row, padded.shape[1] :], alone.sequences[0, len(prompt) :])
