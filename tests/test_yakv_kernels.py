"""YAKV's CUDA kernels against their PyTorch twins, and the YAKV decode step without host synchronisation.

Run on a CUDA machine with cuda-python: `python -m pytest -m gpu -q tests/test_yakv_kernels.py`.
Legend: R stored rows, B cache rows, Hkv KV heads, G query heads per KV head, N stored tokens, K selected
tokens per head, D head dim, p grid dim.
"""

from __future__ import annotations

import pytest
import torch

from shadowkv_cache.kernel_loader import kernels_available
from shadowkv_cache.ops.gather_dequant import gather_dequant, gather_dequant_reference
from shadowkv_cache.quant import HiggsQuantizer
from shadowkv_cache.quantized_store import QuantizedKVStore, pack_records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def needs_kernels():
    if not kernels_available(CUDA):
        pytest.fail('cuda-python is missing: pip install "shadowkv-cache[cuda]" (cuda-bindings) to test the kernels')


def random_vectors(*shape: int) -> torch.Tensor:
    """Gaussian vectors `[..., D]` with norms spread over a few orders of magnitude, the first one zero."""
    x = torch.randn(*shape, device=CUDA) * torch.exp(torch.randn(*shape[:-1], 1, device=CUDA) * 2)
    x.view(-1, shape[-1])[0] = 0
    return x


def pinned_store(rows: int, heads: int, num: int, quantizer: HiggsQuantizer) -> QuantizedKVStore:
    keys = random_vectors(rows, heads, num, quantizer.head_dim)
    values = random_vectors(rows, heads, num, quantizer.head_dim)
    records = pack_records(quantizer.quantize(keys), quantizer.quantize(values))
    store = QuantizedKVStore.offload(records, pin=True)
    assert store.data.is_pinned()
    return store


def assert_dequantised_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Per vector: float32 round-off of a D-term sum (the kernel's Walsh-Hadamard transform against the twin's
    matmul), then at most one step of the output dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().amax(-1, keepdim=True)
    eps = max(torch.finfo(want.dtype).eps, 1e-5)
    assert bool(((got.float() - want.float()).abs() <= eps * scale).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows, heads, num, k, dim, grid_dim",
    [
        (3, 8, 311, 256, 128, 2),
        (2, 3, 77, 13, 64, 2),
        (4, 2, 51, 50, 64, 4),
        (2, 1, 9, 9, 128, 8),
        (2, 3, 40, 7, 16, 2),  # fewer coordinates than lanes
        (2, 2, 33, 5, 256, 2),  # the largest record the kernel takes
        (1, 5, 20, 3, 8, 8),  # one sub-vector: a 6-byte record, byte loads
    ],
)
def test_gather_dequant_kernel_matches_twin(dtype, rows, heads, num, k, dim, grid_dim):
    torch.manual_seed(0)
    quantizer = HiggsQuantizer(dim, grid_dim)
    store = pinned_store(rows, heads, num, quantizer).select_rows(torch.tensor([rows - 1, 0, rows - 1]))
    ids = torch.randint(0, num, (3, heads, k), device=CUDA)
    ids[1, 0, 0] = 0  # the zero vector of stored row 0
    got_keys, got_values = gather_dequant(store, ids, quantizer, dtype)
    want_keys, want_values = gather_dequant_reference(store, ids, quantizer, dtype)
    assert_dequantised_close(got_keys, want_keys)
    assert_dequantised_close(got_values, want_values)
    assert got_keys[1, 0, 0].eq(0).all()


def test_gather_dequant_kernel_reads_a_shared_document_in_place():
    """Rows that share one stored document (row map all zeros) read the same records as the document alone."""
    torch.manual_seed(1)
    quantizer = HiggsQuantizer(128, 2)
    store = pinned_store(1, 8, 500, quantizer)
    shared = store.select_rows(torch.zeros(4, dtype=torch.int64))
    ids = torch.randint(0, 500, (4, 8, 61), device=CUDA)
    got = gather_dequant(shared, ids, quantizer, torch.bfloat16)
    for row in range(4):
        alone = gather_dequant(store, ids[row : row + 1], quantizer, torch.bfloat16)
        assert torch.equal(got[0][row], alone[0][0]) and torch.equal(got[1][row], alone[1][0])


def test_gather_dequant_kernel_handles_an_empty_selection():
    quantizer = HiggsQuantizer(64, 2)
    store = pinned_store(2, 2, 10, quantizer)
    keys, values = gather_dequant(store, torch.zeros(2, 2, 0, dtype=torch.int64, device=CUDA), quantizer, torch.float16)
    assert keys.shape == values.shape == (2, 2, 0, 64)
