"""The `torch.ops.shadowkv` operators (ops/library.py): every kernel entry point registered with a schema, a CUDA
implementation (the kernel), a CPU implementation (the twin) and a fake implementation.

On the CPU (CI): `torch.library.opcheck` on each (schema and mutation declarations, the fake's shapes, dtypes and
strides against the real outputs, AOT dispatch with dynamic shapes); each CPU implementation gives the module twin's
result; `torch.compile(fullgraph=True)` traces each as one opaque node and gives eager's result; the fakes answer for
CUDA tensors without a GPU. On a GPU (marked `gpu`): opcheck on the CUDA implementations (the kernels), with inputs of
the kernels' shapes.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import shadowkv_cache.ops as ops
from shadowkv_cache.core.attention import LogitTerms
from shadowkv_cache.core.attention import attend_parts as attend_parts_twin
from shadowkv_cache.ops.attend_records import attend_records_reference
from shadowkv_cache.ops.gather_dequant import gather_dequant_reference
from shadowkv_cache.ops.gather_values import gather_values_reference
from shadowkv_cache.ops.landmark_logits import landmark_logits_int8_reference, landmark_logits_native_reference
from shadowkv_cache.ops.landmark_scores import landmark_scores_reference
from shadowkv_cache.ops.library import NAMESPACE
from shadowkv_cache.ops.rebuild_keys import RopeLayout, rebuild_keys, rope_reference
from shadowkv_cache.ops.rebuild_missed import rebuild_missed_reference
from shadowkv_cache.ops.score_codes import code_scores_reference
from shadowkv_cache.ops.select_topk import select_topk_reference
from shadowkv_cache.ops.temporal_scan import temporal_scan_reference
from shadowkv_cache.quant import HiggsQuantizer
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, pack_records
from shadowkv_cache.stores.value_store import HostValueStore

CUDA = torch.device("cuda")


def op(name: str):
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _scan(device, g):
    ids = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(6)]).view(2, 3, 6)
    ids[0, 0, 2] = -1
    wanted = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(6)]).view(2, 3, 6)
    valid = torch.rand(2, 3, 6, generator=g) < 0.8
    return ids.to(device), wanted.to(device), valid.to(device)


def _rope(device, g, rotary=48, interleaved=False):
    batch, heads, slots, c, dim, chunks = 2, 2, 3, 4, 64, 5
    keys = torch.randn(batch, heads, slots, c, dim, generator=g).to(device, torch.bfloat16)
    pre = torch.randn(batch, heads, slots, c, dim, generator=g).to(device, torch.bfloat16)
    ids = torch.randint(0, chunks, (batch, heads, slots), generator=g).to(device)
    miss = (torch.rand(batch, heads, slots, generator=g) < 0.6).to(device)
    positions = torch.randint(0, 4000, (batch, chunks * c), generator=g).to(device)
    # Partial rotary by default (48 of 64 dims); without RoPE the kernel never reads its one frequency.
    inv_freq = (10000.0 ** -(torch.arange(0, rotary, 2) / rotary)).float() if rotary else torch.zeros(1)
    return keys, pre, ids, miss, positions, inv_freq.to(device), 1.25, rotary, interleaved


def _attend(device, g, terms=True):
    batch, q_heads, heads, dim = 2, 8, 2, 64
    query = torch.randn(batch, q_heads, 1, dim, generator=g).to(device, torch.bfloat16)
    sizes = (40, 7)
    keys = [torch.randn(batch, heads, n, dim, generator=g).to(device, torch.bfloat16) for n in sizes]
    values = [torch.randn(batch, heads, n, dim, generator=g).to(device, torch.bfloat16) for n in sizes]
    valid = [(torch.rand(batch, 1, 1, n, generator=g) < 0.8).to(device) for n in sizes]
    valid[1][..., -1] = True  # every row holds its own token
    sinks = torch.randn(q_heads, generator=g).to(device)
    return query, keys, values, valid, 1 / math.sqrt(dim), 30.0 if terms else None, sinks if terms else None


def _landmark_logits(device, g):
    batch, heads, group, chunks, dim = 2, 2, 4, 40, 128
    q = torch.randn(batch, heads, group, 1, dim, generator=g).to(device, torch.bfloat16)
    codes = torch.randint(-127, 128, (batch, heads, chunks, dim), generator=g, dtype=torch.int8).to(device)
    scales = (torch.rand(batch, heads, chunks, generator=g) / 100).to(device)
    return q, codes, scales


def _landmark_logits_native(device, g):
    batch, heads, group, chunks, dim = 2, 2, 4, 40, 128
    q = torch.randn(batch, heads, group, 1, dim, generator=g).to(device, torch.bfloat16)
    landmarks = torch.randn(batch, heads, chunks, dim, generator=g).to(device, torch.bfloat16)
    return q, landmarks


def _landmark_scores(device, g):
    logits = torch.randn(2, 2, 3, 1, 30, generator=g).to(device, torch.bfloat16) * 4
    selectable = (torch.rand(2, 2, 30, generator=g) < 0.7).to(device)
    return logits, selectable


QUANTIZER = HiggsQuantizer(64, 4, seed=3)


def _quantize(device, g):
    grid, signs = QUANTIZER.device_tables(device)
    x = torch.randn(3, 5, 64, generator=g).to(device)
    return x, grid, signs, QUANTIZER.grid_dim, QUANTIZER.seed


def _code_scores(device, g):
    batch, heads, group, num = 2, 2, 3, 70
    query = torch.randn(batch, heads, group, 64, generator=g).to(device)
    packed = QUANTIZER.quantize(torch.randn(batch, heads, num, 64, generator=g).to(device))
    selectable = (torch.rand(batch, heads, num, generator=g) < 0.8).to(device)
    grid, _ = QUANTIZER.device_tables(device)
    return QUANTIZER.rotate(query).contiguous(), packed.codes, packed.norms, selectable, grid, 0.125, False


def _records(device, g, rows=2, heads=2, num=30):
    keys, values = (torch.randn(rows, heads, num, 64, generator=g).to(device) for _ in range(2))
    records = pack_records(QUANTIZER.quantize(keys), QUANTIZER.quantize(values))
    return QuantizedKVStore.offload(records, pin=device.type == "cuda")


def _gather_dequant(device, g, some=True):
    store = _records(device, g)
    mirror = store.data[:, :, :12].to(device)  # a mirror of each row's first 12 tokens (read by the twin too)
    ids = torch.randint(0, 30, (2, 2, 9), generator=g).to(device)
    fetch = (torch.rand(2, 2, 9, generator=g) < 0.5).to(device) if some else None  # None: every slot
    keys, values = (torch.zeros(2, 2, 9, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    grid, signs = QUANTIZER.device_tables(device)
    address = store.device_pointer(device) if device.type == "cuda" else 0
    row_map = store.device_row_map(device)
    grid_dim, seed = QUANTIZER.grid_dim, QUANTIZER.seed
    return keys, values, ids, fetch, store.data, address, mirror, row_map, grid, signs, grid_dim, seed


def _attend_records(device, g, terms=True):
    """Four query heads per KV head over 9 selected records (some invalid) of a fully mirrored store, then two
    parts."""
    store = _records(device, g)
    mirror = store.data.to(device)  # every token: the only store the kernel reads
    query, keys, values, valid, scaling, softcap, sinks = _attend(device, g, terms)
    ids = torch.stack([torch.randperm(30, generator=g)[:9] for _ in range(4)]).view(2, 2, 9).to(device)
    chosen = (torch.rand(2, 2, 9, generator=g) < 0.8).to(device)
    grid, signs = QUANTIZER.device_tables(device)
    row_map = store.device_row_map(device)
    return (
        query, ids, chosen, mirror, row_map, grid, signs, QUANTIZER.grid_dim, QUANTIZER.seed, keys, values, valid,
        scaling, softcap, sinks,
    )  # fmt: skip


def _rebuild(device, g, rotary=48, interleaved=False, shared=False):
    """The fused rebuild's arguments: rank 20 (padded to 32 in the kernel), rows of one document when `shared`."""
    batch, heads, slots, c, dim, chunks, rank = 2, 2, 3, 4, 64, 5, 20
    keys = torch.randn(batch, heads, slots, c, dim, generator=g).to(device, torch.bfloat16)
    a = torch.randn(1 if shared else batch, chunks * c, rank, generator=g).to(device, torch.bfloat16)
    b = torch.randn(1 if shared else batch, rank, heads, dim, generator=g).to(device, torch.bfloat16)
    if shared:
        a, b = a.expand(batch, -1, -1), b.expand(batch, -1, -1, -1)
    _, _, ids, miss, positions, inv_freq, scaling, _, _ = _rope(device, g, rotary, interleaved)
    return keys, a, b, ids, miss, positions, inv_freq, scaling, rotary, interleaved


def _select_topk(device, g, k=7, n=40):
    """Scores with ties (rounded to quarters), NaN, -0.0 beside +0.0 and -inf (not selectable) entries."""
    scores = (torch.randn(2, 3, n, generator=g) * 4).round() / 4
    scores[0, 0, :12] = float("-inf")
    scores[0, 1, 3], scores[0, 1, 5] = -0.0, 0.0
    scores[1, 2, 9] = float("nan")
    return scores.to(device), k


def _value_store(device, g, value_format):
    source = torch.randn(2, 2, 6, 8, 64, generator=g).to(device, torch.bfloat16)
    return HostValueStore.offload(source, pin=device.type == "cuda", value_format=value_format)


def _gather_values(device, g, value_format="higgs4"):
    store = _value_store(device, g, value_format)
    values = torch.zeros(2, 2, 4, 8, 64, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 6, (2, 2, 4), generator=g).to(device)
    miss = (torch.rand(2, 2, 4, generator=g) < 0.6).to(device)
    cuda = device.type == "cuda"
    scales = store.scales
    tables = list(store.codec.tables(device)) if value_format == "higgs4" else []
    return (
        values, ids, miss, store.data, store.device_pointer(device) if cuda else 0, scales,
        store.scales_pointer(device) if cuda and scales is not None else 0, store.device_row_map(device),
        value_format, tables,
    )  # fmt: skip


SAMPLES = {
    "temporal_scan": _scan,
    "rope_missed": _rope,
    "rebuild_missed": _rebuild,
    "attend_parts": _attend,
    "attend_records": _attend_records,
    "landmark_logits_int8": _landmark_logits,
    "landmark_logits_native": _landmark_logits_native,
    "landmark_scores": _landmark_scores,
    "quantize_higgs": _quantize,
    "code_scores": _code_scores,
    "gather_dequant": _gather_dequant,
    "gather_values": _gather_values,
    "select_topk": _select_topk,
}
# More paths of the same operators: (operator, sample)
VARIANTS = {
    # The bitmap kernel of long rows (the units the ids index: 12 here).
    "temporal_scan[bitmap]": ("temporal_scan", lambda d, g: (*_scan(d, g), 12)),
    # Misses and scans counted into a [2] int64 tensor (a temporal cache's hit counters), by each kernel.
    "temporal_scan[bitmap, counts]": (
        "temporal_scan",
        lambda d, g: (*_scan(d, g), 12, torch.tensor([5, 2], dtype=torch.int64, device=d)),
    ),
    "temporal_scan[counts]": (
        "temporal_scan",
        lambda d, g: (*_scan(d, g), 0, torch.tensor([5, 2], dtype=torch.int64, device=d)),
    ),
    "rope_missed[interleaved]": ("rope_missed", lambda d, g: _rope(d, g, rotary=64, interleaved=True)),
    "rope_missed[no rope]": ("rope_missed", lambda d, g: _rope(d, g, rotary=0)),
    "rebuild_missed[interleaved, shared]": (
        "rebuild_missed",
        lambda d, g: _rebuild(d, g, rotary=64, interleaved=True, shared=True),
    ),
    "attend_parts[plain]": ("attend_parts", lambda d, g: _attend(d, g, terms=False)),
    "attend_records[plain]": ("attend_records", lambda d, g: _attend_records(d, g, terms=False)),
    "code_scores[tensor cores]": ("code_scores", lambda d, g: (*_code_scores(d, g)[:-1], True)),
    # -inf where not selectable (QuantizedKeyTopK's masked scores), as the tensor-core kernels write it.
    "code_scores[tensor cores, masked]": (
        "code_scores",
        lambda d, g: (*_code_scores(d, g)[:-1], True, float("-inf")),
    ),
    "gather_dequant[every slot]": ("gather_dequant", lambda d, g: _gather_dequant(d, g, some=False)),
    "gather_values[native]": ("gather_values", lambda d, g: _gather_values(d, g, "native")),
    "gather_values[fp8]": ("gather_values", lambda d, g: _gather_values(d, g, "fp8")),
    "select_topk[all]": ("select_topk", lambda d, g: _select_topk(d, g, k=40)),
    # Rows past one block's registers: the split kernels (select_topk_split.cu).
    "select_topk[split]": ("select_topk", lambda d, g: _select_topk(d, g, k=3000, n=17000)),
}
CASES = {**{name: (name, fn) for name, fn in SAMPLES.items()}, **VARIANTS}
# GPU against CPU: (rtol, atol) where the dtype's defaults do not fit. The kernels exponentiate with __expf and sum in
# another order (~1e-5 relative); the tensor-core scores keep fp16 exponentials (2^-11 relative).
TOLERANCES = {
    "landmark_scores": (1e-4, 1e-7),
    "code_scores": (1e-4, 1e-7),
    "code_scores[tensor cores]": (1e-3, 1e-7),
    "code_scores[tensor cores, masked]": (1e-3, 1e-7),
    # Weighted sums of bf16 values in another order, rounded to bf16: a unit in the last place of outputs up to ~1.
    "attend_parts": (1.6e-2, 8e-3),
    "attend_parts[plain]": (1.6e-2, 8e-3),
    # The same, and the twin's keys and values rounded to bf16 where the kernel keeps them in fp32.
    "attend_records": (1.6e-2, 1.6e-2),
    "attend_records[plain]": (1.6e-2, 1.6e-2),
    # Products of rank 20 (up to ~16) summed in another order, then rounded to bf16: two units in the last place.
    "rebuild_missed": (1.6e-2, 0.13),
    "rebuild_missed[interleaved, shared]": (1.6e-2, 0.13),
}
# opcheck's schema test compares float8 inputs with arithmetic the CPU lacks for that dtype; the fp8 store checks the
# rest (the schema is the same for every format).
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECK_UTILS_FP8 = ("test_faketensor", "test_aot_dispatch_dynamic")


def sample(name: str, device: torch.device, seed: int = 0):
    return CASES[name][1](torch.device(device), torch.Generator().manual_seed(seed))


def map_tensors(args, fn):
    """`args` with `fn` applied to every tensor, in lists too."""
    return tuple(
        [fn(t) for t in a] if isinstance(a, list) else fn(a) if isinstance(a, torch.Tensor) else a for a in args
    )


def clone_args(args):
    """Copies of the tensors an operator may write; pinned host stores stay (the kernels read them at their
    address)."""
    return map_tensors(args, lambda t: t if t.is_pinned() else t.clone())


def as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [] if out is None else [out]


def test_every_kernel_is_launched_by_a_registered_operator():
    assert set(ops.OPERATORS) == set(ops.registered_ops()) == set(SAMPLES)
    launched = {stem for stems in ops.OPERATORS.values() for stem in stems}
    assert launched == set(ops.KERNELS)
    for name, schema in ops.registered_ops().items():
        assert str(op(name)._schema).split("(", 1)[1] == schema.split("(", 1)[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck_on_the_cpu(case):
    """Schema, mutations, the fake implementation against the CPU implementation's outputs, AOT dispatch."""
    utils = OPCHECK_UTILS_FP8 if case.endswith("[fp8]") else OPCHECK_UTILS
    torch.library.opcheck(op(CASES[case][0]), sample(case, "cpu"), test_utils=utils)


def test_operators_refuse_what_their_kernels_cannot_mean():
    """A direct call with arguments the kernel would read otherwise than the twin fails on every device, with the
    fix named, instead of answering differently on the CPU and the GPU."""
    query, keys, values, valid, scaling, _, sinks = sample("attend_parts", "cpu")
    with pytest.raises(RuntimeError, match="softcap must be None"):
        op("attend_parts")(query, keys, values, valid, scaling, 0.0, sinks)
    x, grid, signs, grid_dim, _ = sample("quantize_higgs", "cpu")
    with pytest.raises(ValueError, match="pass that quantiser's device_tables"):
        op("quantize_higgs")(x, grid, signs, grid_dim, QUANTIZER.seed + 1)
    logits, selectable = sample("landmark_scores", "cpu")
    with pytest.raises(RuntimeError, match="one query token"):
        op("landmark_scores")(logits.expand(-1, -1, -1, 2, -1), selectable)
    with pytest.raises(RuntimeError, match="one query token"):
        op("attend_parts")(query.expand(-1, -1, 3, -1), keys, values, valid, scaling, None, sinks)
    records = list(sample("attend_records", "cpu"))
    records[0] = records[0].expand(-1, -1, 2, -1)
    with pytest.raises(RuntimeError, match="one query token: call attend_records"):
        op("attend_records")(*records)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match="one query token"):
        op("attend_records")(*records)  # tracing refuses it too, before any kernel is chosen
    args = list(sample("gather_dequant", "cpu"))
    args[-1] += 1  # another seed than the one whose tables are passed
    with pytest.raises(ValueError, match="device_tables"):
        op("gather_dequant")(*args)
    scores, _ = sample("select_topk", "cpu")
    with pytest.raises(RuntimeError, match="1 <= k <= min"):
        op("select_topk")(scores, 41)


def test_cpu_implementations_are_the_twins():
    """Each operator's CPU implementation gives what the module's twin gives on the same inputs."""
    ids, wanted, valid = sample("temporal_scan", "cpu")
    want_ids, want_miss = temporal_scan_reference(ids, wanted, valid)
    got_ids = ids.clone()
    assert torch.equal(op("temporal_scan")(got_ids, wanted, valid), want_miss)
    assert torch.equal(got_ids, want_ids)
    counts = torch.tensor([5, 2])
    op("temporal_scan")(ids.clone(), wanted, valid, 12, counts)
    assert counts.tolist() == [5 + int(want_miss.sum()), 3]

    keys, pre, ids, miss, positions, inv_freq, scaling, rotary, interleaved = sample("rope_missed", "cpu")
    got = keys.clone()
    op("rope_missed")(got, pre, ids, miss, positions, inv_freq, scaling, rotary, interleaved)
    c = keys.shape[3]
    for b, h, k in miss.nonzero().tolist():
        at = positions[b, ids[b, h, k] * c : (ids[b, h, k] + 1) * c]
        want = rope_reference(pre[b, h, k], at, inv_freq, scaling, RopeLayout(rotary, interleaved))
        assert torch.equal(got[b, h, k], want)
    assert torch.equal(got[~miss], keys[~miss])

    keys, a, b, ids, miss, positions, inv_freq, scaling, rotary, interleaved = sample("rebuild_missed", "cpu")
    got = keys.clone()
    op("rebuild_missed")(got, a, b, ids, miss, positions, inv_freq, scaling, rotary, interleaved)
    rope = lambda k, p: rope_reference(k, p, inv_freq, scaling, RopeLayout(rotary, interleaved))  # noqa: E731
    rows, hs, slots = miss.nonzero(as_tuple=True)
    want = rebuild_keys(a, b, positions, rows, hs, ids[rows, hs, slots], keys.shape[3], rope)
    torch.testing.assert_close(got[rows, hs, slots], want, rtol=1.6e-2, atol=0.13)
    assert torch.equal(got[~miss], keys[~miss])
    twin = keys.clone()
    rebuild_missed_reference(twin, a, b, ids, miss, positions, inv_freq, scaling, rotary, interleaved)
    assert torch.equal(got, twin)

    query, keys, values, valid, scaling, softcap, sinks = sample("attend_parts", "cpu")
    want = attend_parts_twin(query, list(zip(keys, values, valid)), scaling, LogitTerms(softcap, sinks))
    assert torch.equal(op("attend_parts")(query, keys, values, valid, scaling, softcap, sinks), want)

    args = sample("attend_records", "cpu")
    query, ids, chosen, mirror, row_map = args[:5]
    keys, values, valid, scaling, softcap, sinks = args[9:]
    store = QuantizedKVStore(mirror, row_map)
    parts = list(zip(keys, values, valid))
    want = attend_records_reference(query, store, ids, chosen, QUANTIZER, parts, scaling, LogitTerms(softcap, sinks))
    assert torch.equal(op("attend_records")(*args), want)

    q, codes, scales = sample("landmark_logits_int8", "cpu")
    got = op("landmark_logits_int8")(q, codes, scales)  # [B, Hkv, C, G]
    assert torch.equal(got.transpose(2, 3).unsqueeze(3), landmark_logits_int8_reference(q, codes, scales))

    q, landmarks = sample("landmark_logits_native", "cpu")
    got = op("landmark_logits_native")(q, landmarks)  # [B, Hkv, C, G]
    assert torch.equal(got.transpose(2, 3).unsqueeze(3), landmark_logits_native_reference(q, landmarks))

    logits, selectable = sample("landmark_scores", "cpu")
    assert torch.equal(op("landmark_scores")(logits, selectable), landmark_scores_reference(logits, selectable))

    x, grid, signs, grid_dim, seed = sample("quantize_higgs", "cpu")
    codes, norms = op("quantize_higgs")(x, grid, signs, grid_dim, seed)
    packed = QUANTIZER.quantize(x)
    assert torch.equal(codes, packed.codes) and torch.equal(norms, packed.norms)

    rotated, codes, norms, selectable, grid, scaling, _ = sample("code_scores", "cpu")
    query = QUANTIZER.unrotate(rotated).reshape(2, 6, 1, 64)  # the queries the rotated ones came from
    want = code_scores_reference(query, codes, norms, selectable, QUANTIZER, scaling)
    torch.testing.assert_close(op("code_scores")(rotated, codes, norms, selectable, grid, scaling, False), want)

    args = sample("gather_dequant", "cpu")
    keys, values, ids, fetch, data, _, mirror, row_map = args[:8]
    op("gather_dequant")(*args)
    store = QuantizedKVStore(data, row_map, mirror)
    want_keys, want_values = gather_dequant_reference(store, ids, QUANTIZER, keys.dtype)
    assert torch.equal(keys[fetch], want_keys[fetch]) and torch.equal(values[fetch], want_values[fetch])
    assert not keys[~fetch].any() and not values[~fetch].any()

    scores, k = sample("select_topk", "cpu")
    got = op("select_topk")(scores, k)
    assert torch.equal(got, select_topk_reference(scores, k))

    for value_format in ("native", "fp8", "higgs4"):
        args = _gather_values(torch.device("cpu"), torch.Generator().manual_seed(5), value_format)
        values, ids, miss, data, _, scales, _, row_map = args[:8]
        store = HostValueStore(data, row_map, scales, ops.gather_values.value_codec(value_format, 64))
        want = values.clone()
        gather_values_reference(want, ids, miss, store)
        op("gather_values")(*args)
        assert torch.equal(values, want) and bool(values[miss].ne(0).any())


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_compile_traces_each_operator_as_one_opaque_node(name):
    """`torch.compile(fullgraph=True)` keeps the operator as one call (no graph break, nothing traced inside it) and
    gives eager's outputs, the arguments it writes included."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def call(*args):
        return op(name)(*args)

    eager_args, compiled_args = sample(name, "cpu"), clone_args(sample(name, "cpu"))
    want = call(*eager_args)
    got = torch.compile(call, backend=backend, fullgraph=True, dynamic=False)(*compiled_args)
    torch._dynamo.reset()
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert targets == [op(name)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(compiled_args, eager_args):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _empty_on(arg, device):
    """An operator argument's shape on `device` (in a fake mode, where tensors are not moved): an empty tensor for a
    tensor, a list of them for a list; anything else as it is."""
    if isinstance(arg, torch.Tensor):
        return torch.empty(arg.shape, dtype=arg.dtype, device=device)
    return [_empty_on(t, device) for t in arg] if isinstance(arg, list) else arg


def test_fakes_answer_for_cuda_tensors_without_a_gpu():
    """Tracing a CUDA program needs no GPU: the fakes give the kernels' output shapes, dtypes and device."""
    cpu_records = sample("attend_records", "cpu")  # built outside: its store and tables are cached per device
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        ids = torch.empty(2, 3, 6, dtype=torch.int64, device=CUDA)
        miss = op("temporal_scan")(ids, ids, torch.empty(2, 3, 6, dtype=torch.bool, device=CUDA))
        assert (miss.shape, miss.dtype, miss.device.type) == ((2, 3, 6), torch.bool, "cuda")
        q = torch.empty(4, 8, 6, 1, 128, dtype=torch.bfloat16, device=CUDA)
        codes = torch.empty(4, 8, 500, 128, dtype=torch.int8, device=CUDA)
        logits = op("landmark_logits_int8")(q, codes, torch.empty(4, 8, 500, device=CUDA))
        assert (logits.shape, logits.dtype, logits.device.type) == ((4, 8, 500, 6), torch.bfloat16, "cuda")
        logits = op("landmark_logits_native")(q, torch.empty(1, 8, 500, 128, dtype=torch.bfloat16, device=CUDA))
        assert (logits.shape, logits.dtype, logits.device.type) == ((4, 8, 500, 6), torch.bfloat16, "cuda")
        rotated = torch.empty(4, 8, 4, 128, device=CUDA)
        codes = torch.empty(4, 8, 900, 32, dtype=torch.uint8, device=CUDA)
        norms = torch.empty(4, 8, 900, dtype=torch.float16, device=CUDA)
        selectable = torch.empty(4, 8, 900, dtype=torch.bool, device=CUDA)
        scores = op("code_scores")(rotated, codes, norms, selectable, torch.empty(256, 4, device=CUDA), 0.1, True)
        assert (scores.shape, scores.dtype, scores.device.type) == ((4, 8, 900), torch.float32, "cuda")
        x = torch.empty(7, 3, 128, dtype=torch.bfloat16, device=CUDA)
        codes, norms = op("quantize_higgs")(x, torch.empty(256, 4, device=CUDA), torch.empty(128, device=CUDA), 4, 0)
        assert (codes.shape, codes.dtype, norms.shape, norms.dtype) == ((7, 3, 32), torch.uint8, (7, 3), torch.float16)
        query = torch.empty(4, 16, 1, 64, dtype=torch.bfloat16, device=CUDA)
        keys = [torch.empty(4, 2, n, 64, dtype=torch.bfloat16, device=CUDA) for n in (100, 3)]
        valid = [torch.empty(4, 1, 1, n, dtype=torch.bool, device=CUDA) for n in (100, 3)]
        out = op("attend_parts")(query, keys, keys, valid, 0.125, None, None)
        assert (out.shape, out.dtype, out.device.type) == ((4, 1, 16, 64), torch.bfloat16, "cuda")
        landmark = torch.empty(4, 8, 6, 1, 500, dtype=torch.bfloat16, device=CUDA)
        chunk_scores = op("landmark_scores")(landmark, torch.empty(4, 8, 500, dtype=torch.bool, device=CUDA))
        assert (chunk_scores.shape, chunk_scores.dtype) == ((4, 8, 500), torch.float32)
        best = op("select_topk")(chunk_scores, 16)
        assert (best.shape, best.dtype) == ((4, 8, 16), torch.int64)
        records = op("attend_records")(*[_empty_on(a, CUDA) for a in cpu_records])
        assert (records.shape, records.dtype, records.device.type) == ((2, 1, 8, 64), torch.bfloat16, "cuda")
        # The kernels write fresh contiguous outputs: so do the fakes.
        for t in (miss, logits, scores, codes, norms, out, chunk_scores, best, records):
            assert t.is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck_on_the_gpu(case):
    """The CUDA implementations (the kernels, on inputs of their shapes) against their schemas and fakes; and each
    gives its CPU implementation's result within the kernels' round-off."""
    name = CASES[case][0]
    args = sample(case, CUDA)
    utils = OPCHECK_UTILS_FP8 if case.endswith("[fp8]") else OPCHECK_UTILS
    torch.library.opcheck(op(name), args, test_utils=utils)
    cpu_args = map_tensors(args, lambda t: t.cpu())
    got_args = clone_args(args)
    got, want = as_list(op(name)(*got_args)), as_list(op(name)(*cpu_args))
    written = [  # the arguments it writes, of those given (an optional one may be left out or None)
        i
        for i, a in enumerate(op(name)._schema.arguments)
        if a.alias_info and a.alias_info.is_write and i < len(args) and args[i] is not None
    ]
    rtol, atol = TOLERANCES.get(case, (None, None))
    for a, b in zip([got_args[i] for i in written] + got, [cpu_args[i] for i in written] + want, strict=True):
        if a.dtype == torch.uint8:  # quantisation codes: a tie between grid points may round either way
            assert int(a.cpu().ne(b).sum()) <= 2
        else:
            torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiles_a_selection_around_the_operators():
    """`torch.compile` (Inductor, fullgraph) of a selection step: landmark scores (operator), top-k (Inductor's), the
    temporal scan (operator, writes the held ids): eager's results, with the operators left as calls among
    Inductor's kernels."""
    g = torch.Generator().manual_seed(2)
    batch, heads, group, chunks, k = 9, 8, 4, 2000, 64
    logits = torch.randn(batch, heads, chunks, group, generator=g).to(CUDA, torch.bfloat16).transpose(2, 3)
    logits = logits.unsqueeze(3)  # [B, Hkv, G, 1, C], strided as the landmark GEMM writes it
    selectable = (torch.rand(batch, heads, chunks, generator=g) < 0.9).to(CUDA)
    held = torch.randint(0, chunks, (batch, heads, k), generator=g).to(CUDA)

    def select(logits, selectable, ids):
        scores = op("landmark_scores")(logits, selectable)
        top = scores.topk(k, dim=-1)
        miss = op("temporal_scan")(ids, top.indices, top.values > float("-inf"))
        return top.indices, miss

    want_ids, got_ids = held.clone(), held.clone()
    want = select(logits, selectable, want_ids)
    got = torch.compile(select, fullgraph=True)(logits, selectable, got_ids)
    torch._dynamo.reset()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got_ids, want_ids)
