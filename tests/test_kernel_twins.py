"""CPU tests of the kernels' PyTorch twins, the pinned pool's bookkeeping, the kernel loader's JIT contract, and
the registry that pairs every kernel with its op and twin (design.md §10).

Legend: B batch, Hkv KV heads, G query heads per KV head, T query tokens, K slots, C chunks, c chunk size,
D head dim, N units (tokens or chunks).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowkv_cache.core.attention import NO_TERMS
from shadowkv_cache.ops import KERNELS
from shadowkv_cache.ops import loader as kernel_loader
from shadowkv_cache.ops.gather_values import gather_values
from shadowkv_cache.ops.quantize_higgs import quantize_vectors, vector_strides
from shadowkv_cache.ops.rebuild_keys import RopeLayout, rope_reference
from shadowkv_cache.ops.score_codes import attention_scores
from shadowkv_cache.ops.temporal_scan import temporal_scan_reference, temporal_scan_sorted
from shadowkv_cache.quant import HiggsQuantizer
from shadowkv_cache.stores.pinned_pool import PinnedPool
from shadowkv_cache.stores.value_store import HostValueStore

TESTS = Path(__file__).resolve().parent
# Every CUDA source of the repository, by stem: the list the registry and the loader tests must cover.
KERNEL_STEMS = sorted(p.stem for p in (TESTS.parent / "kernels").glob("*.cu"))


def random_scan_case(batch: int, heads: int, slots: int, chunks: int, seed: int):
    """Old ids (distinct per head, some empty), wanted (distinct, overlapping the old), valid (a budget per row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((batch, heads, slots), -1, dtype=torch.int64)
    wanted = torch.empty((batch, heads, slots), dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            perm = torch.randperm(chunks, generator=gen)
            held = int(torch.randint(0, slots + 1, (), generator=gen))
            ids[b, h, torch.randperm(slots, generator=gen)[:held]] = perm[:held]
            shift = int(torch.randint(0, chunks - slots + 1, (), generator=gen))
            wanted[b, h] = perm[shift : shift + slots]
    budget = torch.randint(0, slots + 1, (batch, 1, 1), generator=gen)
    valid = (torch.arange(slots) < budget).expand(batch, heads, slots)
    return ids, wanted, valid


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    slots=st.integers(1, 13),
    extra=st.integers(0, 40),
    seed=st.integers(0, 10**6),
)
def test_temporal_scan_twin_holds_exactly_the_wanted_chunks(batch, heads, slots, extra, seed):
    ids, wanted, valid = random_scan_case(batch, heads, slots, slots + extra, seed)
    new_ids, miss = temporal_scan_reference(ids, wanted, valid)
    for b in range(batch):
        for h in range(heads):
            want = set(wanted[b, h][valid[b, h]].tolist())
            held = [x for x in new_ids[b, h].tolist() if x >= 0]
            assert sorted(held) == sorted(want)  # every wanted chunk held once, nothing else
            for s in range(slots):
                old, new = int(ids[b, h, s]), int(new_ids[b, h, s])
                if old in want:  # a hit never moves
                    assert new == old and not miss[b, h, s]
                # a miss is a slot that got a chunk it did not hold
                assert bool(miss[b, h, s]) == (new >= 0 and new != old and new not in ids[b, h].tolist())
            assert int(miss[b, h].sum()) == len(want - set(ids[b, h].tolist()))


def test_temporal_scan_twin_fills_free_slots_in_order():
    ids = torch.tensor([[[5, -1, 7, 9]]])
    wanted = torch.tensor([[[9, 1, 2, 3]]])
    valid = torch.tensor([[[True, True, True, False]]])
    new_ids, miss = temporal_scan_reference(ids, wanted, valid)
    # 9 stays in slot 3; new chunks 1, 2 take free slots 0, 1; slot 2 (7, no longer wanted) empties.
    assert new_ids.tolist() == [[[1, 2, -1, 9]]]
    assert miss.tolist() == [[[True, True, False, False]]]


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    slots=st.integers(1, 40),
    extra=st.integers(0, 60),
    seed=st.integers(0, 10**6),
)
def test_sorted_temporal_scan_equals_the_twin(batch, heads, slots, extra, seed):
    """The O(K log K) scan (YAKV's thousands of tokens per head) gives the twin's ids and misses exactly."""
    ids, wanted, valid = random_scan_case(batch, heads, slots, slots + extra, seed)
    want_ids, want_miss = temporal_scan_reference(ids, wanted, valid)
    got_ids, got_miss = temporal_scan_sorted(ids, wanted, valid)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_miss, want_miss)
    assert got_ids is ids  # in place, as the kernel


def test_sorted_temporal_scan_at_yakv_sizes():
    """4096 slots per head, where the twin's K x K comparison would take 16M entries per head: a step that keeps
    60% of the previous one's tokens holds the new selection and misses exactly the rest."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, slots, tokens = 2, 2, 4096, 131072
    perm = torch.stack([torch.randperm(tokens, generator=gen) for _ in range(batch * heads)]).view(batch, heads, -1)
    ids = perm[..., :slots].contiguous()
    kept = int(0.6 * slots)
    wanted = torch.cat([perm[..., slots - kept : slots].flip(-1), perm[..., slots : 2 * slots - kept]], dim=-1)
    valid = torch.ones_like(wanted, dtype=torch.bool)
    old = ids.clone()
    new_ids, miss = temporal_scan_sorted(ids, wanted, valid)
    assert torch.equal(new_ids.sort(-1).values, wanted.sort(-1).values)
    assert int(miss.sum()) == batch * heads * (slots - kept)
    assert torch.equal(new_ids[~miss], old[~miss])  # a held token never moves


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    groups=st.integers(1, 4),
    q_len=st.integers(1, 3),
    num=st.integers(1, 40),
    seed=st.integers(0, 10**6),
)
def test_attention_scores_twin_is_the_group_max_of_softmaxes(batch, heads, groups, q_len, num, seed):
    """The twin of softmax_group_max.cu (and the tail of `code_scores_reference`), by its properties: each query
    row is a softmax over the selectable units, so a (row, head) sums to between T (the G heads agree) and G*T;
    units that are not selectable score 0 and their logits do not matter; a shift of one query row's logits
    changes nothing; G identical query heads score as one."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, heads, groups * q_len, num, generator=gen, dtype=torch.float64) * 4
    selectable = torch.rand(batch, heads, num, generator=gen) < 0.7
    selectable[0, 0] = False  # a head with nothing selectable
    scores = attention_scores(logits, selectable, groups)
    assert scores.shape == (batch, heads, num) and bool(scores.isfinite().all())
    assert bool((scores[~selectable] == 0).all()) and bool((scores >= 0).all())
    totals = scores.sum(-1)
    some = selectable.any(-1)
    assert bool((totals[~some] == 0).all())
    assert bool((totals[some] >= q_len - 1e-9).all()) and bool((totals[some] <= groups * q_len + 1e-9).all())

    noise = torch.randn(logits.shape, generator=gen, dtype=torch.float64) * 100
    elsewhere = logits.where(selectable[:, :, None, :], noise)  # other logits where nothing may be selected
    torch.testing.assert_close(attention_scores(elsewhere, selectable, groups), scores)
    shift = torch.randn(batch, heads, groups * q_len, 1, generator=gen, dtype=torch.float64) * 50
    torch.testing.assert_close(attention_scores(logits + shift, selectable, groups), scores)

    one_head = logits[:, :, :q_len]  # query head 0 of each group, its T rows
    alone = attention_scores(one_head, selectable, 1)
    torch.testing.assert_close(attention_scores(one_head.repeat(1, 1, groups, 1), selectable, groups), alone)


def test_attention_scores_twin_ranks_units_by_their_best_query_head():
    """One query token: a unit's score is its largest probability under any head of the group."""
    logits = torch.tensor([[[[2.0, 0.0, 1.0, 5.0], [0.0, 3.0, 0.0, 9.0]]]])  # [1, 1, G=2, N=4]
    selectable = torch.tensor([[[True, True, True, False]]])
    scores = attention_scores(logits, selectable, 2)[0, 0]
    assert scores[3] == 0  # the largest logits, but not selectable
    assert scores.argmax() == 1  # head 1 puts most of its mass on unit 1
    assert scores[0] > scores[2]  # head 0 prefers unit 0 to unit 2; head 1 is indifferent between them


def test_gather_values_twin_reads_the_store_through_row_map():
    data = torch.randn(3, 2, 11, 4, 5)
    store = HostValueStore.offload(data, pin=False).select_rows(torch.tensor([2, 0]))
    ids = torch.randint(0, 11, (2, 2, 7))
    miss = torch.rand(2, 2, 7) < 0.5
    values = torch.zeros(2, 2, 7, 4, 5)
    gather_values(values, ids, miss, store)
    rows = torch.tensor([2, 0])
    for b in range(2):
        for h in range(2):
            for k in range(7):
                expected = data[rows[b], h, ids[b, h, k]] if miss[b, h, k] else torch.zeros(4, 5)
                assert torch.equal(values[b, h, k], expected)


# The RoPE layouts of the key-rebuild kernel, each with an architecture whose modeling file implements it:
# (architecture, tiny-config overrides, layout, whether its attention hands RoPE the rotary dims only).
ROPE_LAYOUTS = {
    "rotate-half": ("llama", {}, RopeLayout(16), False),
    "rotate-half-partial-sliced-inside": ("gpt_neox", {}, RopeLayout(4), False),
    "rotate-half-partial-sliced-before": ("phi", {}, RopeLayout(8), True),
    "interleaved-partial": ("glm", {}, RopeLayout(8, interleaved=True), False),
    "interleaved": ("cohere", {}, RopeLayout(16, interleaved=True), False),
}


@pytest.mark.parametrize("name", list(ROPE_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_reference_is_the_models_own_rope(name, dtype):
    """`rope_reference`, the RoPE `kernels/rebuild_keys.cu` computes, against the modeling module's own
    `apply_rotary_pos_emb` with its rotary module's cos/sin, called the way its attention calls it."""
    from helpers import make_tiny_model

    from shadowkv_cache.hf.adapters import SUPPORTED_ARCHITECTURES

    arch, overrides, layout, sliced_before = ROPE_LAYOUTS[name]
    model = make_tiny_model(arch, **overrides)
    rotary = model.base_model.rotary_emb
    apply_rotary = importlib.import_module(SUPPORTED_ARCHITECTURES[arch]).apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 40, 16, generator=gen).to(dtype)  # [B, Hkv, T, D]
    positions = torch.randint(0, 100_000, (3, 40), generator=gen)
    cos, sin = rotary(keys, positions)
    r = cos.shape[-1]
    if sliced_before:  # Phi and StableLM rotate `key[..., :rotary_ndims]` and concatenate the rest back
        _, rotated = apply_rotary(keys[..., :r], keys[..., :r], cos, sin)
        expected = torch.cat((rotated, keys[..., r:]), dim=-1)
    else:
        _, expected = apply_rotary(keys, keys, cos, sin)
    got = rope_reference(keys, positions[:, None], rotary.inv_freq, rotary.attention_scaling, layout)
    assert got.dtype == dtype
    # The model rounds cos/sin to the keys' dtype before multiplying; the kernel keeps them in fp32.
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 4)
    assert torch.equal(got[..., r:], keys[..., r:])
    # The other pairing is far off: the layout matters.
    other = RopeLayout(layout.rotary_dim, not layout.interleaved)
    wrong = rope_reference(keys, positions[:, None], rotary.inv_freq, rotary.attention_scaling, other)
    assert (wrong.float() - expected.float()).abs().max() > 0.5


def test_rope_reference_without_rotary_dims_is_the_identity():
    keys = torch.randn(2, 5, 16)
    assert torch.equal(rope_reference(keys, torch.arange(5).expand(2, 5), torch.ones(0), 1.0, RopeLayout(0)), keys)


@pytest.mark.parametrize("rotary_dim", [-2, 3])
def test_rope_layout_refuses_an_odd_or_negative_rotary_dim(rotary_dim):
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RopeLayout(rotary_dim)


class FakePinning:
    def __init__(self, fail_after: int | None = None):
        self.pinned, self.unpinned, self.fail_after = [], [], fail_after

    def register(self, t):
        if self.fail_after is not None and len(self.pinned) - len(self.unpinned) >= self.fail_after:
            raise RuntimeError("out of pinnable memory")
        self.pinned.append(t.data_ptr())

    def unregister(self, t):
        self.unpinned.append(t.data_ptr())


def numbered(*shape: int) -> torch.Tensor:
    """A tensor whose every element holds its own storage offset (exact in float64)."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)


@pytest.mark.parametrize(
    "make, folds",
    [
        (lambda: numbered(3, 4, 5, 8), True),  # contiguous: one level
        (lambda: numbered(2, 4, 9, 8)[1, :, 2:7], True),  # keys[row, :, span]: heads x tokens
        (lambda: numbered(2, 9, 4, 8).transpose(1, 2)[0, :, 2:7], True),  # [B, S, Hkv, D] storage, transposed
        (lambda: numbered(1, 4, 1, 5, 8), True),  # size-1 dims step nowhere
        (lambda: numbered(2, 3, 8, 8)[:, :, ::2], True),  # every other token of each row: still one level
        (lambda: numbered(8), True),  # a single vector
        (lambda: numbered(2, 3, 8, 8)[:, :2, :5], False),  # three strided levels
        (lambda: numbered(3, 1, 5, 8).expand(3, 4, 5, 8), False),  # a stride-0 middle dim between two others
        (lambda: numbered(5, 8, 4).transpose(-1, -2), False),  # coordinates not contiguous
    ],
)
def test_vector_strides_address_every_vector_of_a_view(make, folds):
    """The kernel's two-level addressing, n -> (n // inner) * outer + (n % inner) * inner_stride elements past the
    view's storage offset, names each vector's first coordinate (the tensors hold their own offsets)."""
    x = make()
    strides = vector_strides(x)
    assert (strides is not None) == folds
    if not folds:
        return
    inner, outer_stride, inner_stride = strides
    n = torch.arange(x[..., 0].numel(), dtype=torch.float64)
    starts = x.storage_offset() + torch.div(n, inner, rounding_mode="floor") * outer_stride + n % inner * inner_stride
    assert torch.equal(x.reshape(-1, x.shape[-1])[:, 0], starts)


def test_quantize_vectors_on_the_cpu_is_the_quantiser():
    quantizer = HiggsQuantizer(32, 4)
    x = torch.randn(3, 7, 40, 32, dtype=torch.bfloat16)[:, :, 5:30]
    got, want = quantize_vectors(quantizer, x), quantizer.quantize(x)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.norms, want.norms)
    with pytest.raises(ValueError, match="head_dim=32"):
        quantize_vectors(quantizer, torch.randn(4, 16))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_vectors(quantizer, torch.ones(4, 32, dtype=torch.int64))


def test_pinned_pool_reuses_freed_blocks_and_grows():
    pins = FakePinning()
    pool = PinnedPool(pins.register, pins.unregister)
    a = pool.allocate((4, 1000), torch.float32)
    assert a.shape == (4, 1000) and a.dtype == torch.float32
    first = a.data_ptr()
    b = pool.allocate((4, 1000), torch.float32)  # a is in use: a second block
    assert len(pins.pinned) == 2 and b.data_ptr() != first
    del a
    c = pool.allocate((2, 2000), torch.float32)  # same bytes: the freed block is reused, nothing pinned
    assert c.data_ptr() == first and len(pins.pinned) == 2
    assert pool.used_bytes == pool.pinned_bytes
    del b, c
    assert pool.used_bytes == 0
    pinned = pool.pinned_bytes
    assert pool.release_cached() == pinned
    assert len(pins.unpinned) == 2 and pool.pinned_bytes == 0


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (`/proc/self/smaps`)."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        low, high = (int(x, 16) for x in entry.split()[0].split("-"))
        if low <= address < high:
            return int(re.search(r"AnonHugePages:\s+(\d+) kB", entry).group(1)) << 10
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pinned_pool_on_huge_pages_hands_out_aligned_blocks_of_2_mib_pages(monkeypatch):
    """With `HUGE_PAGES` a new block is an anonymous mapping aligned to 2 MiB and advised to use huge pages; it holds
    what is written, is pinned and reused as other blocks are, and is backed by huge pages where the kernel gives
    them (transparent huge pages not `never`)."""
    from shadowkv_cache.stores import pinned_pool as module

    monkeypatch.setattr(module, "HUGE_PAGES", True)
    pins = FakePinning()
    pool = PinnedPool(pins.register, pins.unregister)
    a = pool.allocate((3 << 20,), torch.uint8)
    assert a.data_ptr() % (2 << 20) == 0 and pool.pinned_bytes == 4 << 20 and len(pins.pinned) == 1
    a.copy_(torch.arange(3 << 20).to(torch.uint8))
    assert torch.equal(a[-5:], torch.arange((3 << 20) - 5, 3 << 20).to(torch.uint8))
    first = a.data_ptr()
    del a
    b = pool.allocate((2 << 20,), torch.float16)  # the same 4 MiB: reused
    assert b.data_ptr() == first and len(pins.pinned) == 1
    b.fill_(1.5)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():  # else an aligned mapping of normal pages
        assert _anon_huge_bytes(b.data_ptr()) >= 2 << 20


def test_pinned_pool_does_not_spend_a_large_block_on_a_small_request():
    pins = FakePinning()
    pool = PinnedPool(pins.register, pins.unregister)
    big = pool.allocate((64 << 20,), torch.uint8)
    del big
    small = pool.allocate((1 << 20,), torch.uint8)
    assert len(pins.pinned) == 2 and pool.pinned_bytes == (64 << 20) + (2 << 20)
    del small


def test_pinned_pool_frees_cached_blocks_when_pinning_fails():
    pins = FakePinning(fail_after=1)
    pool = PinnedPool(pins.register, pins.unregister)
    a = pool.allocate((64 << 20,), torch.uint8)
    del a  # free but still pinned
    b = pool.allocate((4 << 20,), torch.uint8)  # too small for the free block; pinning fails once, retried
    assert pins.unpinned and pool.pinned_bytes == 4 << 20
    c = None
    with pytest.raises(RuntimeError):
        c = pool.allocate((4 << 20,), torch.uint8)  # nothing left to release
    del b, c


def test_loader_compiles_once_then_reads_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("SHADOWKV_NO_COMPILE", raising=False)
    calls = []

    def fake_compile(name, source, headers, options):
        calls.append((name, tuple(options)))
        assert "common.cuh" in headers and "extern" in source
        return b"cubin:" + name.encode()

    first = kernel_loader.cubin_for("temporal_scan", "sm_90", fake_compile, tmp_path)
    again = kernel_loader.cubin_for("temporal_scan", "sm_90", fake_compile, tmp_path)
    assert first == again == b"cubin:temporal_scan.cu" and len(calls) == 1
    assert "--gpu-architecture=sm_90" in calls[0][1]
    kernel_loader.cubin_for("temporal_scan", "sm_80", fake_compile, tmp_path)  # another arch: another file
    assert len(calls) == 2
    names = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert len(names) == 2 and all(n.startswith(f"temporal_scan-{kernel_loader.__version__}-sm_") for n in names)
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


def test_loader_cache_key_follows_the_source(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.cu").write_text("extern void k();")
    (src / "common.cuh").write_text("// v1")
    monkeypatch.setattr(kernel_loader, "source_dir", lambda: src)
    compiled = []

    def fake(name, source, headers, options):
        compiled.append(headers["common.cuh"])
        return b"x"

    kernel_loader.cubin_for("k", "sm_90", fake, tmp_path / "cache")
    (src / "common.cuh").write_text("// v2")  # a header change must recompile
    kernel_loader.cubin_for("k", "sm_90", fake, tmp_path / "cache")
    assert compiled == ["// v1", "// v2"]


def test_loader_no_compile_switch_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOWKV_NO_COMPILE", "1")
    with pytest.raises(kernel_loader.KernelError, match="SHADOWKV_NO_COMPILE"):
        kernel_loader.cubin_for("gather_values", "sm_90", lambda *a: b"x", tmp_path)


def test_loader_names_a_missing_source(tmp_path):
    with pytest.raises(kernel_loader.KernelError, match="not found"):
        kernel_loader.cubin_for("no_such_kernel", "sm_90", lambda *a: b"x", tmp_path)


def test_loader_without_cuda_python_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ImportError("no module named cuda")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(kernel_loader.KernelError, match=r"shadowkv-cache\[cuda\]"):
        kernel_loader._cuda_bindings()


def test_every_kernel_source_is_found():
    assert len(KERNEL_STEMS) >= 7
    for stem in KERNEL_STEMS:
        source, headers = kernel_loader._sources(stem)  # through the package's kernels/ link
        assert "\\brief" in source and 'extern "C" __global__' in source and "common.cuh" in headers


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])  # Ampere (A100) and Hopper (H100, H200)
def test_nvrtc_compiles_every_kernel_when_available(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    try:
        probe = 'extern "C" __global__ void k() {}'
        kernel_loader._nvrtc_compile("probe.cu", probe, {}, [f"--gpu-architecture={arch}"])
    except Exception as err:  # cuda-python without an NVRTC library
        pytest.skip(f"NVRTC unusable here: {err}")
    # NVRTC releases the GIL: compiling on every core takes ~0.7x the time of one after another on 2 cores.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        cubins = pool.map(lambda stem: kernel_loader.cubin_for(stem, arch, directory=tmp_path), KERNEL_STEMS)
        for stem, cubin in zip(KERNEL_STEMS, cubins):
            assert cubin[:4] == b"\x7fELF", stem


def names_called_in_tests() -> set[str]:
    """Names of every function a test file calls (`f(...)` or `module.f(...)`)."""
    called = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", None))
    return called


def test_the_kernel_registry_names_exactly_the_kernel_sources():
    assert sorted(KERNELS) == KERNEL_STEMS


@pytest.mark.parametrize("stem", KERNEL_STEMS)
def test_every_kernel_has_an_op_that_launches_it_and_a_tested_twin(stem):
    module_name, twin_name = KERNELS[stem]
    module = importlib.import_module(module_name)
    assert callable(getattr(module, twin_name)), f"{module_name}.{twin_name}"
    assert f'load_kernels("{stem}"' in Path(module.__file__).read_text(), f"{module_name} never launches {stem}"
    assert twin_name in names_called_in_tests(), f"no test calls {twin_name}, the twin of kernels/{stem}.cu"
    source, _ = kernel_loader._sources(stem)
    twin_path = module_name.replace(".", "/") + ".py"
    assert f"Twin: {twin_path}" in source, f"kernels/{stem}.cu does not name its twin's module {twin_path}"


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 200_000), blocks=st.integers(1, 4096), sms=st.integers(1, 200), tile=st.sampled_from([32, 64])
)
def test_attend_parts_splits_cover_every_slot_once(total, blocks, sms, tile):
    from shadowkv_cache.ops import attend_parts as op

    original = op.multiprocessors
    op.multiprocessors = lambda device: sms
    try:
        splits, span = op.splits_for(total, blocks, tile, torch.device("cuda", 0))
    finally:
        op.multiprocessors = original
    assert span % tile == 0 and span >= tile
    assert (splits - 1) * span < total <= splits * span  # every split has slots, and all slots have a split
    assert splits * blocks <= op._BLOCKS_PER_SM * sms + blocks  # about as many blocks as the GPU wants, not more


def test_attend_parts_off_cuda_is_the_twin():
    from shadowkv_cache.core.attention import attend_parts as definition
    from shadowkv_cache.ops.attend_parts import attend_parts, attend_parts_reference, kernel_fits

    assert attend_parts_reference is definition
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 1, 16, generator=g)
    parts = [(*torch.randn(2, 2, 2, n, 16, generator=g), torch.rand(2, 1, 1, n, generator=g) < 0.8) for n in (8, 20)]
    parts[-1][2][..., 0] = True
    assert not kernel_fits(query, parts, NO_TERMS)
    assert torch.equal(attend_parts(query, parts, 0.25), definition(query, parts, 0.25))


def test_attend_parts_kernel_declines_what_it_cannot_serve(monkeypatch):
    """Inputs the kernels would get wrong or cannot launch run the twin: an empty batch (a grid of size 0), a
    soft-cap of 0 (the kernel reads it as none), several query tokens, a head size of odd 16-byte units."""
    from shadowkv_cache.core.attention import LogitTerms
    from shadowkv_cache.ops import attend_parts as op

    monkeypatch.setattr(op, "kernels_available", lambda device: True)

    def case(batch=2, tokens=1, dim=128, heads=2, group=4):
        query = torch.zeros(batch, heads * group, tokens, dim, dtype=torch.bfloat16)
        query.is_cuda  # noqa: B018 - a CPU tensor stands in: only shapes, strides and dtypes are checked
        parts = [
            (
                *torch.zeros(2, batch, heads, 64, dim, dtype=torch.bfloat16),
                torch.ones(batch, 1, 1, 64, dtype=torch.bool),
            )
        ]
        return query, parts

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    query, parts = case()
    assert op.kernel_fits(query, parts, NO_TERMS)
    assert op.kernel_fits(query, parts, LogitTerms(softcap=30.0))
    assert not op.kernel_fits(query, parts, LogitTerms(softcap=0.0))
    assert not op.kernel_fits(*case(batch=0), NO_TERMS)
    assert not op.kernel_fits(*case(tokens=2), NO_TERMS)
    assert not op.kernel_fits(*case(dim=96), NO_TERMS)  # 12 units of 16 bytes
    assert not op.kernel_fits(*case(group=9), NO_TERMS)


def test_landmark_logits_kernels_serve_what_they_can_read(monkeypatch):
    """Both landmark-logit kernels take one-token steps of 16-bit queries whose landmarks (int8 codes with one fp32
    scale each, or 16-bit landmarks of the query's dtype) lie in 16-byte rows; anything else runs the twin, and the
    16-bit kernel serves at most `NATIVE_KERNEL_MAX_ROWS` rows when that is set."""
    from shadowkv_cache.ops import landmark_logits as op

    monkeypatch.setattr(op, "kernels_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # CPU tensors stand in

    def query(batch=2, heads=8, group=4, tokens=1, dim=128, dtype=torch.bfloat16):
        return torch.zeros(batch, heads, group, tokens, dim, dtype=dtype)

    landmarks = torch.zeros(2, 8, 100, 128, dtype=torch.bfloat16)
    assert op.native_kernel_fits(query(), landmarks)
    assert op.native_kernel_fits(query(), landmarks[:1])  # one shared document
    assert not op.native_kernel_fits(query(), landmarks.half())  # another dtype than the query's
    assert not op.native_kernel_fits(query(tokens=2), landmarks)
    assert not op.native_kernel_fits(query(group=9), landmarks)
    assert not op.native_kernel_fits(query(dim=96), landmarks[..., :96])
    assert not op.native_kernel_fits(query(dtype=torch.float32), landmarks.float())
    assert not op.native_kernel_fits(query(), landmarks[:, :, :0])  # no landmark
    unaligned = torch.zeros(2, 8, 100, 132, dtype=torch.bfloat16)[..., :128]  # rows 264 bytes apart
    assert not op.native_kernel_fits(query(), unaligned)
    monkeypatch.setattr(op, "NATIVE_KERNEL_MAX_ROWS", 8)
    assert op.native_kernel_fits(query(batch=1), landmarks[:1]) and not op.native_kernel_fits(query(), landmarks)
    assert op.native_kernel_fits(query(), landmarks, max_rows=None)

    codes, scales = torch.zeros(2, 8, 100, 128, dtype=torch.int8), torch.zeros(2, 8, 100)
    assert op._kernel_fits(query(), codes, scales)
    assert not op._kernel_fits(query(), codes, scales[:, :, :99])
    assert not op._kernel_fits(query(), codes, scales.double())
    assert not op._kernel_fits(query(), codes.to(torch.uint8), scales)
    assert not op._kernel_fits(query(), torch.zeros(2, 8, 100, 136, dtype=torch.int8)[..., :128], scales)


def test_landmark_scores_kernel_serves_every_one_token_step_it_can_read(monkeypatch):
    """The scores kernel splits each (row, KV head) over blocks, so it serves batch 1 as well as large batches; several
    query tokens, more than 16 query heads per KV head, a strided mask and no chunks run the twin."""
    from shadowkv_cache.ops import landmark_scores as op

    monkeypatch.setattr(op, "kernels_available", lambda device: True)

    def fits(batch=32, heads=8, group=4, tokens=1, chunks=100, strided_mask=False):
        logits = torch.zeros(batch, heads, group, tokens, chunks, dtype=torch.bfloat16)  # shapes, strides, dtypes only
        selectable = torch.ones(batch, heads, 2 * chunks if strided_mask else chunks, dtype=torch.bool)
        return op._kernel_fits(logits, selectable[..., ::2] if strided_mask else selectable)

    assert fits() and fits(batch=1) and fits(batch=1, heads=1) and fits(group=16)
    assert not fits(tokens=2) and not fits(group=17) and not fits(strided_mask=True) and not fits(chunks=0)
    logits = torch.zeros(2, 8, 17, 1, 10, dtype=torch.bfloat16)
    assert "17 query heads" in op._refusal(logits, torch.ones(2, 8, 10, dtype=torch.bool))
    assert "dtype" in op._refusal(logits[:, :, :4].int(), torch.ones(2, 8, 10, dtype=torch.bool))
    assert op._refusal(logits[:, :, :4], torch.ones(2, 8, 10, dtype=torch.bool)) is None


def test_landmark_scores_grid_splits_a_row_head_only_while_the_gpu_is_short_of_blocks():
    from shadowkv_cache.ops import landmark_scores as op

    rounds = op._THREADS * op._UNROLL  # the chunks one block reads in its first round
    assert op._splits(1, 8, 16384, 132) == 16384 // rounds  # batch 1: as many as have a round of chunks each
    assert op._splits(1, 8, 1000, 132) == -(-1000 // rounds)
    assert op._splits(4, 8, 16384, 132) == -(-op.BLOCKS_PER_SM * 132 // 32)  # the SMs' worth
    assert op._splits(44, 8, 16384, 132) == 2 and op._splits(200, 8, 16384, 132) == 1
    assert op._splits(1, 1, 1, 132) == 1


def test_landmark_scores_vector_loads_only_where_a_chunks_logits_lie_aligned_side_by_side():
    """One 16- or 8-byte load per chunk needs the group's logits adjacent, every row, head and chunk stride a
    multiple of the load, and the last chunk's load inside the storage."""
    from shadowkv_cache.ops import landmark_scores as op

    def gemm_output(batch, heads, chunks, width, group, dtype=torch.bfloat16):  # `[B, Hkv, C, width]`, G used
        return torch.zeros(batch, heads, chunks, width, dtype=dtype)[..., :group].transpose(-1, -2).unsqueeze(3)

    assert op._vector_bytes(gemm_output(2, 8, 100, 8, 4)) == 16  # the padded product (16 bytes per chunk)
    assert op._vector_bytes(gemm_output(2, 8, 100, 4, 4)) == 8  # the int8 kernel's [B, Hkv, C, G]
    assert op._vector_bytes(gemm_output(2, 8, 100, 8, 4, torch.float32)) == 16
    assert op._vector_bytes(gemm_output(2, 8, 100, 8, 7, torch.float32)) == 0  # 28 bytes: one load per logit
    assert op._vector_bytes(gemm_output(2, 8, 100, 16, 16)) == 0  # 32 bytes
    assert op._vector_bytes(gemm_output(2, 8, 100, 3, 3)) == 0  # 6-byte chunk stride
    assert op._vector_bytes(torch.zeros(2, 8, 4, 1, 100, dtype=torch.bfloat16)) == 0  # query heads C apart
    assert op._vector_bytes(gemm_output(2, 8, 100, 8, 4)[..., 1:]) == 16  # chunk offsets keep the alignment
    assert op._vector_bytes(gemm_output(2, 8, 100, 9, 4)) == 0  # 18-byte chunk stride
    # A view whose storage ends at its last logit: a 16-byte load there would read past it.
    storage = torch.zeros((2 * 8 * 100 - 1) * 8 + 4, dtype=torch.bfloat16)
    tight = storage.as_strided((2, 8, 4, 1, 100), (8 * 100 * 8, 100 * 8, 1, 1, 8))
    assert op._vector_bytes(tight) == 8
    # An offset that breaks the alignment of the first logit.
    assert op._vector_bytes(storage[1:].as_strided((2, 8, 4, 1, 99), (6400, 800, 1, 1, 8))) == 0
