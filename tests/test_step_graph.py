"""What the whole-step CUDA graph (hf/step_graph.py) decides on the host, and the token buffer's device cursor it
relies on. The capture and replay themselves run on CUDA (tests/test_gpu.py)."""

import pytest
import torch
from helpers import forward_with, make_tiny_model, random_prompt, small_budget_overrides
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_outputs import CausalLMOutputWithPast

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.hf.decode_graph import collector_paused
from shadowkv_cache.hf.step_graph import StepGraph, _cloned, _step_inputs, _step_key, _without
from shadowkv_cache.stores.token_buffer import TokenBuffer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def prefilled():
    model = make_tiny_model("llama")
    cache = ShadowKVCache(model, **small_budget_overrides())
    forward_with(model, random_prompt(301), cache)
    return model, cache


def _call(**changes):
    ids = torch.tensor([[5]])
    return {"input_ids": ids, "attention_mask": torch.ones(1, 302, dtype=torch.long), "use_cache": True, **changes}


def test_a_one_token_step_is_served_with_positions_filled_in_and_the_mask_left_out(prefilled):
    model, cache = prefilled
    with torch.no_grad():
        inputs = _step_inputs(cache, model, model.forward, (), _call(past_key_values=cache, logits_to_keep=1))
    assert inputs is not None and "attention_mask" not in inputs
    assert inputs["past_key_values"] is cache and inputs["logits_to_keep"] == 1
    # The model would read the cache's length on the host; a capture would freeze it, so the graph takes it as input.
    assert inputs["position_ids"].tolist() == [[cache.get_seq_length()]]


@pytest.mark.parametrize(
    "why, changes, grad",
    [
        ("several tokens", {"input_ids": torch.tensor([[5, 6]])}, False),
        ("autograd on", {}, True),
        ("attentions asked for", {"output_attentions": True}, False),
        ("hidden states asked for", {"output_hidden_states": True}, False),
        ("no cache", {"use_cache": False}, False),
        ("embeddings given", {"inputs_embeds": torch.zeros(1, 1, 64)}, False),
    ],
)
def test_calls_a_graph_cannot_serve_run_as_called(prefilled, why, changes, grad):
    model, cache = prefilled
    with torch.set_grad_enabled(grad):
        assert _step_inputs(cache, model, model.forward, (), _call(past_key_values=cache, **changes)) is None, why


def test_a_model_placed_by_accelerate_on_several_devices_runs_as_called(prefilled):
    model, cache = prefilled
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    try:
        with torch.no_grad():
            assert _step_inputs(cache, model, model.forward, (), _call(past_key_values=cache)) is None
    finally:
        del model.hf_device_map


def test_layers_off_cuda_give_no_key_and_decode_as_before(prefilled):
    """On the CPU no layer is graph-safe: every step runs eagerly, and the cache counts no replay."""
    model, cache = prefilled
    with torch.no_grad():
        inputs = _step_inputs(cache, model, model.forward, (), _call(past_key_values=cache))
    assert _step_key(cache, inputs) is None
    fresh = ShadowKVCache(model, **small_budget_overrides())
    forward_with(model, random_prompt(301), fresh)
    with torch.no_grad():
        for token in (5, 6, 7):
            model(input_ids=torch.tensor([[token]]), past_key_values=fresh, use_cache=True)
    assert fresh.step_graphs.replays == 0 and fresh.get_seq_length() == 304


def test_outputs_are_copied_out_of_the_graph_but_the_cache_is_not():
    logits = torch.randn(2, 1, 7)
    cache = object()
    out = _cloned(CausalLMOutputWithPast(logits=logits, past_key_values=cache))
    assert type(out) is CausalLMOutputWithPast and out.past_key_values is cache
    assert torch.equal(out.logits, logits) and out.logits.data_ptr() != logits.data_ptr()
    pair = _cloned((logits, cache))
    assert pair[1] is cache and pair[0].data_ptr() != logits.data_ptr()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "crop", "rows", "advance"]), st.integers(1, 3)), max_size=12))
def test_token_buffer_cursor_follows_its_length(operations):
    """Every operation keeps the device cursor at the host length, and appends land where the cursor was: the same
    tokens as concatenating them, whether the buffer grew or not. `advance` stands for a replayed append (the graph
    wrote the token and moved the cursor on the device)."""
    gen = torch.Generator().manual_seed(len(operations))
    buffer = TokenBuffer(torch.randn(2, 1, 3, 4, generator=gen), torch.randn(2, 1, 3, 4, generator=gen))
    keys = [buffer.keys[:, :, :3].clone()]
    for name, n in operations:
        if name == "append":
            new = torch.randn(2, 1, n, 4, generator=gen)
            buffer.append(new, new * 2)
            keys.append(new)
        elif name == "crop":
            held = torch.cat(keys, dim=2)[:, :, : max(0, buffer.length - n)]
            buffer.crop(held.shape[2])
            keys = [held]
        elif name == "rows":
            buffer = buffer.select_rows(torch.tensor([1, 0]))
            keys = [torch.cat(keys, dim=2)[[1, 0]]]
        elif buffer.fits(1):  # a replayed one-token step: the graph's append, then the host's count
            new = torch.randn(2, 1, 1, 4, generator=gen)
            buffer.keys[:, :, buffer.length] = new[:, :, 0]
            buffer.valid[:, buffer.length] = True
            buffer.cursor += 1
            buffer.advance(1)
            keys.append(new)
        assert int(buffer.cursor) == buffer.length
    held_keys, held_values = buffer.held()
    torch.testing.assert_close(held_keys, torch.cat(keys, dim=2))
    assert buffer.valid[:, : buffer.length].all() and not buffer.valid[:, buffer.length :].any()
    assert held_values.shape == held_keys.shape


def test_the_graph_keeps_no_reference_to_the_cache_it_serves():
    """A captured output without the cache (put back at each replay): a cache holding a graph that holds the cache
    would be freed by the cyclic collector only, with its GPU and pinned memory."""
    cache = object()
    logits = torch.randn(1, 1, 5)
    stripped, where = _without(CausalLMOutputWithPast(logits=logits, past_key_values=cache), cache)
    assert where in ("cache", "past_key_values")  # the field's name in Transformers 5.24 / before
    assert all(value is not cache for value in stripped.values()) and torch.equal(stripped.logits, logits)
    stripped, where = _without((logits, cache), cache)
    assert where == 1 and stripped[1] is None
    assert _without(logits, cache) == (logits, None)
    # What a replay returns: the stored output, copied, with the cache of the call put back where it was.
    for output in (CausalLMOutputWithPast(logits=logits, past_key_values=cache), (logits, cache)):
        graph = StepGraph.__new__(StepGraph)
        graph.output, graph._cache_at = _without(output, cache)
        got = graph.output_with(cache)
        assert type(got) is type(output) and got[1 if isinstance(got, tuple) else graph._cache_at] is cache
        assert torch.equal(got[0], logits) and got[0].data_ptr() != logits.data_ptr()


def test_a_failed_call_drops_the_whole_step_graph(prefilled):
    """A call that raises puts the layers back; a graph captured on their later state must not survive it."""
    model, cache = prefilled
    cache.step_graphs._last_key, cache.step_graphs.graph = ("a key",), object()
    with pytest.raises(TypeError), torch.no_grad():  # fails inside the model, after the layers were checkpointed
        model(input_ids=torch.tensor([[5, 6]]), past_key_values=cache, use_cache=True, position_ids="not a tensor")
    assert cache.step_graphs.graph is None and cache.step_graphs._last_key is None


def test_the_collector_stays_off_until_the_last_capture_in_progress_ends():
    import gc
    import threading

    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def other_capture():
        with collector_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other_capture)
    thread.start()
    entered.wait(10)
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread still captures
    release.set()
    thread.join()
    assert gc.isenabled()


@pytest.mark.parametrize(
    "model_type, fields, capturable",
    [
        ("llama", {}, True),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, True),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, False),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, False),
        ("mixtral", {}, False),
        ("qwen3_moe", {}, False),
        ("gpt_oss", {}, False),
        ("gemma3_text", {}, True),
    ],
)
def test_models_whose_forward_synchronises_are_not_captured_whole(model_type, fields, capturable):
    """Mixture-of-experts routing and position-dependent RoPE tables read tensors on the host at every step."""
    from types import SimpleNamespace

    from transformers import CONFIG_MAPPING

    from shadowkv_cache.hf.step_graph import capturable_model

    config = CONFIG_MAPPING[model_type]()
    for name, value in fields.items():
        setattr(config, name, value)
    assert capturable_model(SimpleNamespace(config=config)) == capturable
