"""The throughput benchmark's batch sweeps hold one cache at a time.

A sweep that kept the previous batch's cache alive while building the next ran its larger batches out of GPU memory
they had (the benchmark then records no row for them, and the ratios against the best batch are wrong without any
error). These tests follow each cache with a weak reference on the CPU, where the sweeps run the same code.
"""

from __future__ import annotations

import argparse
import gc
import weakref

import pytest
import torch

from benchmarks import throughput_sweeps
from benchmarks.fills import fill_dynamic
from benchmarks.speed import build_model
from shadowkv_cache import ShadowKVConfig


class _Rows:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)


def _run(methods: str, batches: list[int]) -> throughput_sweeps.Run:
    torch.manual_seed(0)
    args = argparse.Namespace(methods=methods, warm=1, steps=1, no_static=True)
    model = build_model(True, torch.device("cpu"))
    return throughput_sweeps.Run(
        args=args, model=model, config=ShadowKVConfig(), device=torch.device("cpu"), contexts=[256],
        batches=batches, rec=_Rows(), weights=1, hbm_bw=1e12, total_gpu=1 << 40,
    )  # fmt: skip


def test_each_batch_of_the_sweep_is_built_after_the_last_cache_is_gone(monkeypatch):
    made: list[weakref.ref] = []

    def fill(model, batch, length):
        gc.collect()
        alive = [ref for ref in made if ref() is not None]
        assert not alive, f"batch {batch} was built while {len(alive)} earlier cache(s) were alive"
        cache = fill_dynamic(model, batch, length)
        made.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(throughput_sweeps, "fill_dynamic", fill)
    run = _run("dynamic", [1, 2, 3])
    throughput_sweeps.full_attention_sweeps(run)
    measured = [row["batch"] for row in run.rec.rows if row["method"] == "dynamic"]
    assert measured == [1, 2, 3]
    gc.collect()
    assert all(ref() is None for ref in made)


def test_a_batch_that_does_not_fit_is_logged_and_its_memory_freed(monkeypatch):
    run = _run("dynamic", [1])
    made: list[weakref.ref] = []

    def build():
        cache = fill_dynamic(run.model, 1, 64)
        made.append(weakref.ref(cache))
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    assert throughput_sweeps.measure_decode(run, build, 1, "dynamic 64 batch 1") is None
    gc.collect()
    assert made and made[0]() is None


def test_other_errors_of_a_build_propagate():
    run = _run("dynamic", [1])

    def build():
        raise ValueError("not a memory error")

    with pytest.raises(ValueError, match="not a memory error"):
        throughput_sweeps.measure_decode(run, build, 1, "dynamic 64 batch 1")


def test_a_row_records_where_its_gpu_memory_lies(monkeypatch):
    """Off CUDA a row has no memory fields but the peak's None; on a GPU `built_gpu_gib` is read once the cache is
    built and `held_gpu_gib` after its steps, and a ShadowKVCache's row adds what its memory report counts."""
    from benchmarks import speed
    from shadowkv_cache.testing import synthetic_cache

    run = _run("shadowkv", [1])
    config = ShadowKVConfig(min_compress_len=128)
    build = lambda: synthetic_cache(run.model, 1, 256, config)  # noqa: E731
    _, _, gpu = throughput_sweeps.measure_decode(run, build, 1, "shadowkv 256 batch 1")
    assert gpu == {"peak_gpu_gib": None}

    readings = iter([3.0, 5.0, 7.0, 9.0])  # GiB allocated: once built, then after the steps (two rows)
    monkeypatch.setattr(throughput_sweeps, "allocated_gib", lambda device: next(readings))
    made = []
    _, _, gpu = throughput_sweeps.measure_decode(run, lambda: made.append(build()) or made[-1], 1, "again")
    assert (gpu["built_gpu_gib"], gpu["held_gpu_gib"]) == (3.0, 5.0)
    assert gpu["cache_gpu_gib"] == made[0].memory_report().gpu_bytes / speed.GiB > 0
    _, _, gpu = throughput_sweeps.measure_decode(run, lambda: fill_dynamic(run.model, 1, 64), 1, "dynamic")
    assert (gpu["built_gpu_gib"], gpu["held_gpu_gib"]) == (7.0, 9.0) and "cache_gpu_gib" not in gpu  # a DynamicCache
