"""The invariants on CUDA, with values in pinned host memory. Run with `pytest -m gpu` on a CUDA machine."""

import logging

import pytest
import torch
from helpers import (
    ARCHS,
    GEMMA3,
    assert_logits_close,
    assert_within_bf16_noise,
    decoded_in_graphs,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
)
from transformers.generation.streamers import BaseStreamer

from shadowkv_cache import LandmarkTopK, ShadowKVCache
from shadowkv_cache.fidelity import measure_fidelity, natural_text_ids, teacher_forced_logits
from shadowkv_cache.hf import fused_pieces
from shadowkv_cache.hf.adapters import patch_model
from shadowkv_cache.hf.sliding_layer import SlidingLayer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module", params=ARCHS)
def cuda_model(request):
    return make_tiny_model(request.param).cuda()


def test_full_budget_exact_on_cuda(cuda_model):
    ids = random_prompt(301).cuda()
    ref = generate_with(cuda_model, ids, dynamic_cache(cuda_model))
    cache = ShadowKVCache(cuda_model, **full_budget_overrides())
    got = generate_with(cuda_model, ids, cache)

    assert torch.equal(got.sequences, ref.sequences)
    # CUDA SDPA kernels sum in another order than CPU ones: fp32 round-off reaches ~5e-5 on logits of ~3.
    assert_logits_close(got.logits, ref.logits, atol=1e-4)
    for layer in cache.layers:
        assert layer.is_compressed
        assert layer.prompt.values.data.is_pinned()
        assert layer.prompt.a.is_cuda and layer.mode.temporal.keys.is_cuda
    temporal = cache.layers[0].mode.temporal
    assert int(temporal.lookups) > int(temporal.hits)


def test_padded_batch_rows_equal_rows_alone_on_cuda(cuda_model):
    rows = [random_prompt(300, seed=1)[0], random_prompt(211, seed=2)[0], random_prompt(40, seed=3)[0]]
    ids, mask = left_pad(rows)
    together = generate_with(
        cuda_model, ids.cuda(), ShadowKVCache(cuda_model, **small_budget_overrides()), attention_mask=mask.cuda()
    )
    for i, row in enumerate(rows):
        alone = generate_with(cuda_model, row[None].cuda(), ShadowKVCache(cuda_model, **small_budget_overrides()))
        assert torch.equal(together.sequences[i, ids.shape[1] :], alone.sequences[0, len(row) :])
        torch.testing.assert_close(
            torch.stack([step[i] for step in together.logits]),
            torch.stack([step[0] for step in alone.logits]),
            rtol=1e-4,
            atol=1e-4,
        )


@pytest.fixture(scope="module")
def smollm2_cuda():
    from shadowkv_cache.embedded_models import load_smollm2

    return load_smollm2(dtype=torch.float32, device="cuda")


def _eager_and_graphed(model, ids, **kwargs):
    out = {}
    for graphs in (False, True):
        cache = ShadowKVCache(model, cuda_graphs=graphs, **small_budget_overrides())
        out[graphs] = (generate_with(model, ids, cache, **kwargs), cache)
    return out


def test_graphed_decode_equals_eager_decode(cuda_model):
    """300 new tokens: the token buffer grows past its first capacity (256), so the graphs are captured again."""
    ids = random_prompt(301).cuda()
    (eager, eager_cache), (graphed, graphed_cache) = _eager_and_graphed(cuda_model, ids, max_new_tokens=300).values()
    assert decoded_in_graphs(graphed_cache) and graphed_cache.step_graphs.replays > 250  # the whole step, in graphs
    assert not decoded_in_graphs(eager_cache)
    assert torch.equal(graphed.sequences, eager.sequences)
    assert_logits_close(graphed.logits, eager.logits, atol=1e-5)
    # The device-side hit counters are updated by the replays too.
    assert graphed_cache.memory_report().hit_rate == eager_cache.memory_report().hit_rate


def test_graphed_decode_follows_reordered_rows(cuda_model):
    """Beam search reorders rows every step: each reorder moves the tensors, and the graph must follow."""
    ids = random_prompt(260, seed=4).cuda()
    runs = _eager_and_graphed(cuda_model, ids, max_new_tokens=12, num_beams=3)
    assert torch.equal(runs[True][0].sequences, runs[False][0].sequences)


def test_graphed_decode_across_chat_turns(cuda_model):
    """A second turn (a multi-token step, eager) between graphed one-token steps."""
    first, second = random_prompt(280, seed=5).cuda(), random_prompt(9, seed=6).cuda()
    results = {}
    for graphs in (False, True):
        cache = ShadowKVCache(cuda_model, cuda_graphs=graphs, **small_budget_overrides())
        turn1 = generate_with(cuda_model, first, cache, max_new_tokens=8).sequences
        turn2 = generate_with(cuda_model, torch.cat([turn1, second], dim=1), cache, max_new_tokens=8)
        results[graphs] = turn2
    assert torch.equal(results[True].sequences, results[False].sequences)
    assert_logits_close(results[True].logits, results[False].logits, atol=1e-5)


class _Collect(BaseStreamer):
    """A streamer that keeps what `generate` streams (any batch size)."""

    def __init__(self):
        self.seen = []

    def put(self, value):
        self.seen.append(value.clone().cpu())

    def end(self):
        pass


def test_whole_step_graph_keeps_generate_features(cuda_model):
    """The whole one-token step replayed as one graph serves `generate` as the eager step does: a left-padded batch,
    sampling, a streamer and stopping criteria (an end token that finishes rows at different steps); the outputs of
    earlier steps are not overwritten by later replays."""
    rows = [random_prompt(300, seed=11)[0], random_prompt(260, seed=12)[0], random_prompt(290, seed=13)[0]]
    ids, mask = (t.cuda() for t in left_pad(rows))
    plain_cache = ShadowKVCache(cuda_model, cuda_graphs=False, **small_budget_overrides())
    plain = generate_with(cuda_model, ids, plain_cache, attention_mask=mask, max_new_tokens=40)
    eos = int(plain.sequences[0, ids.shape[1] + 20])  # row 0 stops there (if not before), the others if they meet it
    runs = {}
    for graphs in (False, True):
        cache = ShadowKVCache(cuda_model, cuda_graphs=graphs, **small_budget_overrides())
        streamer = _Collect()
        torch.manual_seed(0)
        sampled = generate_with(
            cuda_model, ids, cache, attention_mask=mask, max_new_tokens=40, do_sample=True, top_k=4, streamer=streamer
        )
        fresh = ShadowKVCache(cuda_model, cuda_graphs=graphs, **small_budget_overrides())
        stopped = generate_with(
            cuda_model, ids, fresh, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, pad_token_id=0
        )
        runs[graphs] = (sampled, torch.cat(streamer.seen[1:], dim=-1), stopped, cache)
    (sampled, streamed, stopped, _), (g_sampled, g_streamed, g_stopped, g_cache) = runs[False], runs[True]
    assert g_cache.step_graphs.replays >= 30
    assert torch.equal(g_sampled.sequences, sampled.sequences)
    assert_logits_close(g_sampled.logits, sampled.logits, atol=1e-5)
    assert torch.equal(g_streamed.reshape(-1), g_sampled.sequences[:, ids.shape[1] :].T.reshape(-1).cpu())
    assert torch.equal(g_streamed, streamed)
    assert torch.equal(g_stopped.sequences, stopped.sequences)
    assert (stopped.sequences[0, ids.shape[1] + 21 :] == 0).all()  # row 0 ended at its end token, then padding
    assert_logits_close(g_stopped.logits, stopped.logits, atol=1e-5)


def test_whole_step_graph_outputs_stay_valid_in_raw_forwards(cuda_model):
    """Raw forwards (not `generate`): each call's logits are the caller's own (cloned out of the graph), and the
    graph is captured at the second step of a key and replayed from the third."""
    ids = random_prompt(301, seed=14).cuda()
    caches = {g: ShadowKVCache(cuda_model, cuda_graphs=g, **small_budget_overrides()) for g in (False, True)}
    logits = {}
    with torch.no_grad():
        for graphs, cache in caches.items():
            out = cuda_model(ids, past_key_values=cache, use_cache=True)
            token, steps = out.logits[:, -1:].argmax(-1), []
            for _ in range(12):
                steps.append(
                    cuda_model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                )
                token = steps[-1][:, -1:].argmax(-1)
            logits[graphs] = torch.cat(steps, dim=1)
    assert caches[True].step_graphs.replays == 12 - 3  # growth, first step of the key, capture
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_smollm2_bf16_whole_step_graph_matches_eager(smollm2_cuda):
    """SmolLM2 in bf16 on a 4K natural-text prompt: the graphed steps give the eager steps' tokens."""
    model, tokenizer = smollm2_cuda
    model = model.to(torch.bfloat16)
    try:
        ids = natural_text_ids(tokenizer, 4096).cuda()
        runs = {}
        for graphs in (False, True):
            cache = ShadowKVCache(model, cuda_graphs=graphs)
            runs[graphs] = (generate_with(model, ids, cache, max_new_tokens=48), cache)
        (eager, _), (graphed, cache) = runs[False], runs[True]
        assert cache.step_graphs.replays >= 40
        assert torch.equal(graphed.sequences, eager.sequences)
        torch.testing.assert_close(torch.stack(graphed.logits), torch.stack(eager.logits), rtol=2e-2, atol=5e-2)
    finally:
        model.to(torch.float32)


def test_fused_pieces_decode_as_the_models_own(cuda_model):
    """`compile_model_ops` (the default) runs the model's norms, MLPs and RoPE compiled in the one-token steps, inside
    the whole-step graph: the tokens and logits of the model's own pieces (fp32: within round-off)."""
    ids = random_prompt(301, seed=21).cuda()
    runs = {}
    for fused in (False, True):
        cache = ShadowKVCache(cuda_model, compile_model_ops=fused, **small_budget_overrides())
        runs[fused] = (generate_with(cuda_model, ids, cache, max_new_tokens=24), cache)
    (plain, _), (fused, cache) = runs[False], runs[True]
    assert cache.step_graphs.replays >= 20
    for module in (cuda_model.model.norm, cuda_model.model.layers[0].mlp):
        piece = fused_pieces._COMPILED[type(module).forward]
        assert not piece.failed and piece._compiled is not None
    assert all("forward" not in vars(m) for m in patch_model(cuda_model).pieces.modules(cuda_model))
    assert torch.equal(fused.sequences, plain.sequences)
    assert_logits_close(fused.logits, plain.logits, atol=1e-5)


@pytest.mark.slow
def test_smollm2_bf16_fused_pieces_match_the_models_own(smollm2_cuda):
    """SmolLM2 in bf16 on a 4K natural-text prompt: the compiled pieces round where eager rounds, so the steps give the
    tokens of the model's own kernels."""
    model, tokenizer = smollm2_cuda
    model = model.to(torch.bfloat16)
    try:
        ids = natural_text_ids(tokenizer, 4096).cuda()
        runs = {}
        for fused in (False, True):
            cache = ShadowKVCache(model, compile_model_ops=fused)
            runs[fused] = generate_with(model, ids, cache, max_new_tokens=32)
        assert torch.equal(runs[True].sequences, runs[False].sequences)
        assert_within_bf16_noise(torch.stack(runs[True].logits), torch.stack(runs[False].logits))
    finally:
        model.to(torch.float32)


@pytest.mark.slow
def test_smollm2_full_budget_exact_on_cuda(smollm2_cuda):
    model, tokenizer = smollm2_cuda
    ids = natural_text_ids(tokenizer, 4096 + 16).cuda()
    kv_dim = model.config.num_key_value_heads * model.config.head_dim
    cache = ShadowKVCache(model, rank=kv_dim, sparse_budget=10**6, outlier_chunks=4, min_compress_len=2048)
    got = teacher_forced_logits(model, ids, 4096, cache)
    ref = teacher_forced_logits(model, ids, 4096, dynamic_cache(model))
    # CUDA's fp32 SDPA kernels round differently for a reordered, masked key set; over 30 layers that
    # reaches ~3e-3 on logits of ~35 (CPU: 5e-5). Hold the error to 1e-4 of the logit scale.
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert cache.layers[0].prompt.values.data.is_pinned()


@pytest.mark.slow
@pytest.mark.parametrize("landmark_format", ["native", "int8"])
def test_smollm2_bf16_default_fidelity_on_cuda(smollm2_cuda, landmark_format):
    """The defaults in bf16 hold the floor, with landmarks in the KV dtype or in int8 through their kernel (head dim
    64, 3 query heads per KV head)."""
    model, tokenizer = smollm2_cuda
    model = model.to(torch.bfloat16)
    try:
        ids = natural_text_ids(tokenizer, 4096 + 64).cuda()
        make = lambda: ShadowKVCache(model, policy=LandmarkTopK(landmark_format))  # noqa: E731
        fid = measure_fidelity(model, ids, 4096, make, greedy_tokens=32)
        print(f"SmolLM2 bf16 CUDA 4K default fidelity, {landmark_format} landmarks: {fid}")
        assert fid.agreement >= 0.8
    finally:
        model.to(torch.float32)


def test_failed_capture_falls_back_to_eager_and_leaves_cuda_usable(cuda_model, monkeypatch, caplog):
    """A step that fails while it is captured (say, out of memory in the key rebuild, after the value fetch has
    forked onto the side stream) must end the capture cleanly: decoding goes on eagerly with the same tokens, and
    the process can still draw CUDA random numbers (a capture that cannot end leaves the generator in capture
    mode)."""
    import shadowkv_cache.shadowkv.temporal_cache as temporal_cache

    ids = random_prompt(301, seed=7).cuda()
    eager = generate_with(cuda_model, ids, ShadowKVCache(cuda_model, cuda_graphs=False, **small_budget_overrides()))
    rebuild = temporal_cache.rebuild_missed_keys

    def failing_while_capturing(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("injected: out of memory during capture")
        return rebuild(*args, **kwargs)

    monkeypatch.setattr(temporal_cache, "rebuild_missed_keys", failing_while_capturing)
    cache = ShadowKVCache(cuda_model, **small_budget_overrides())
    with caplog.at_level(logging.WARNING, logger="shadowkv_cache"):
        got = generate_with(cuda_model, ids, cache)
    # Once per cache and kind: the whole step's capture fails first, then each layer's (the same injected error).
    messages = [r.getMessage() for r in caplog.records if "could not capture" in r.getMessage()]
    assert len(messages) == 2 and "whole decode step" in messages[0] and "whole" not in messages[1]
    assert not cache._graphs.enabled
    assert all(layer._graph is None for layer in cache.layers)
    assert torch.equal(got.sequences, eager.sequences)
    assert_logits_close(got.logits, eager.logits, atol=1e-5)
    assert torch.randn(4, device="cuda").isfinite().all()


# Prefix files beyond ShadowKV on plain models (tests/test_prefix_modes.py on the CPU): (arch, cache options).
PREFIX_KINDS = {
    "gemma3": (GEMMA3, small_budget_overrides()),
    "yakv": ("llama", {"mode": "yakv", "sparse_budget": 24, "min_compress_len": 64}),
}


@pytest.mark.parametrize("kind", PREFIX_KINDS)
def test_prefix_round_trip_on_cuda(kind, tmp_path):
    """Saved from the device, loaded onto it: host stores pinned again, device tensors on CUDA, sliding windows
    restored, and the loaded prefix (graphed one-token steps where the mode captures them) answers as the fork of
    the cache it was saved from."""
    arch, options = PREFIX_KINDS[kind]
    model = make_tiny_model(arch).cuda()
    document, question = random_prompt(240, seed=800)[0], random_prompt(6, seed=801)[0]
    doc = ShadowKVCache.prefill(model, document, **options)
    doc.save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    for layer in loaded.layers:
        if isinstance(layer, SlidingLayer):
            assert layer.keys.is_cuda and layer.cumulative_length == 240
        else:
            store = layer.prompt.store if kind == "yakv" else layer.prompt.values
            assert store.data.is_pinned() and layer.prompt.local_keys.is_cuda
    ids = torch.cat([document, question])[None].cuda()
    want = generate_with(model, ids, doc.fork(), max_new_tokens=16)
    got = generate_with(model, ids, loaded, max_new_tokens=16)
    assert torch.equal(got.sequences, want.sequences)
    assert_logits_close(got.logits, want.logits, atol=1e-5)
    if kind == "gemma3":  # at full budget, also the model's own DynamicCache
        ShadowKVCache.prefill(model, document, **full_budget_overrides()).save_prefix(tmp_path / "full.safetensors")
        full = generate_with(model, ids, ShadowKVCache.load_prefix(model, tmp_path / "full.safetensors"))
        ref = generate_with(model, ids, dynamic_cache(model))
        assert torch.equal(full.sequences, ref.sequences)
        assert_logits_close(full.logits, ref.logits, atol=1e-4)  # CUDA SDPA sums in another order


@pytest.mark.parametrize("share", [0.0, 0.6])
def test_yakv_prefill_batch_on_cuda(share):
    """YAKV prompts joined on the device: the joined store is pinned (and mirrored on the device for a share), and each
    row decodes as its prompt alone."""
    model = make_tiny_model("llama").cuda()
    options = {**PREFIX_KINDS["yakv"][1], "device_record_share": share}
    rows = [random_prompt(n, seed=810 + n)[0] for n in (260, 190)]
    ids, mask = left_pad(rows)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **options)
    assert all(layer.prompt.store.data.is_pinned() for layer in cache.layers)
    for layer in cache.layers:
        store = layer.prompt.store
        assert store.mirrored_tokens == int(share * store.data.shape[2])
        assert store.mirror is None or torch.equal(store.mirror.cpu(), store.data[:, :, : store.mirrored_tokens])
    together = generate_with(model, ids.cuda(), cache, attention_mask=mask.cuda(), max_new_tokens=8)
    for i, row in enumerate(rows):
        alone_cache = ShadowKVCache.prefill(model, row[:-1], **options)
        alone = generate_with(model, row[None].cuda(), alone_cache, max_new_tokens=8)
        assert torch.equal(together.sequences[i, -8:], alone.sequences[0, -8:])
        torch.testing.assert_close(
            torch.stack([step[i] for step in together.logits]),
            torch.stack([step[0] for step in alone.logits]),
            rtol=1e-4,
            atol=1e-4,
        )


@pytest.mark.parametrize("rows, chunks, k", [(8, 16380, 256), (16, 8190, 128), (3, 1000, 24)])
def test_few_short_rows_select_as_topk_does_on_cuda(rows, chunks, k):
    """Batch 1 at 128K (8 rows of 16K chunks) takes the two-stage top-k on CUDA: torch.topk's scores, best first, and
    its indices (random scores do not tie); also inside a CUDA graph."""
    from shadowkv_cache.policies.base import best_indices

    scores = torch.randn(1, rows, chunks, device="cuda")
    scores[..., ::5] = float("-inf")
    want = scores.topk(k, dim=-1)
    got = best_indices(scores, k)
    assert torch.equal(scores.gather(-1, got), want.values) and torch.equal(got, want.indices)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = best_indices(scores, k)
    scores.copy_(torch.randn_like(scores))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, scores.topk(k, dim=-1).indices)
