"""Prefix reuse: time to first token from a saved prefix against a fresh prefill, load time against file size,
and host memory for N questions over one document, shared against separate copies.

Legend: S context tokens, N questions, L layers, Hkv KV heads, D head dim.

Llama-3.1-8B shape with random bf16 weights built on the GPU (speed does not depend on weight values). Per
context S:
1. fresh: `ShadowKVCache.prefill` of the document, then `generate` of document + a 32-token question for one
   token (TTFT). Twice: the first run also pins fresh host memory for the values (slow on that machine,
   about 1.5 GB/s), the second reuses the pinned blocks the first freed, as a long-running server would;
2. the prefix is saved (time, file size), then loaded and answered (TTFT) with the file evicted from the page
   cache (a cold read from disk) and again with it cached;
3. host memory: the values of one document in host memory (the `HostValueStore` bytes), for N questions held
   once (a shared batch, `cache.fork(N)`) or N times (separate caches); the largest N that fits in the host
   RAM (125 GiB on the H200 machine) for each, and the largest shared batch the GPU holds (from the measured
   per-question GPU bytes). Then the shared batch is run at `--batch` questions (measured: peak GPU memory,
   host RSS, time to the first token of all questions) and two separate copies are loaded to check the
   separate figure.

    python -m benchmarks.prefix_reuse --device cuda                     # the H200 run, both contexts
    python -m benchmarks.prefix_reuse --device cuda --contexts 32768    # one context (results accumulate)
    python -m benchmarks.prefix_reuse --device cpu --small              # a tiny CPU run that checks the script

Disk: a prefix file at 128K is about 10.5 GiB (8 GiB of values, 1.25 GiB of factors at rank 160, 1 GiB of
landmarks); it is written to `--dir` (default: a temporary directory next to the results) and deleted after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.results_io import add_results_dir_option, environment, results_dir, write_results
from benchmarks.speed import PAPER_SETTINGS, GiB, build_model, free, host_rss, log, peak_gpu_gib, reset_peak, sync
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.prefix import batch_questions

warnings.filterwarnings("ignore", category=FutureWarning)

HOST_RAM = 125 * 2**30  # the H200 machine's host RAM
QUESTION = 32  # tokens per question


def peak(device) -> dict:
    return {"peak_gpu_gib": peak_gpu_gib(device)} if device.type == "cuda" else {}


def evict_from_page_cache(path: Path) -> None:
    """Drop the file's pages from the page cache, so the next read comes from disk (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def first_token(model, cache, ids: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False)


def timed(fn, device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def ttft_rows(model, context: int, settings: dict, device, directory: Path) -> tuple[list[dict], dict]:
    """Fresh prefill (twice) and loaded prefix (cold and warm file) TTFT at one context; and the sizes."""
    gen = torch.Generator().manual_seed(context)
    vocab = model.config.vocab_size
    document = torch.randint(10, vocab, (context,), generator=gen)
    ids = torch.cat([document, torch.randint(10, vocab, (QUESTION,), generator=gen)])[None].to(device)
    path = directory / f"prefix_{context}.safetensors"
    rows, sizes = [], {"path": path, "document": document}

    for run in ("fresh prefill (cold pinned memory)", "fresh prefill"):
        free(device)
        reset_peak(device)
        prefill_s, doc = timed(lambda: ShadowKVCache.prefill(model, document, **settings), device)
        answer_s, _ = timed(lambda d=doc: first_token(model, d.fork(), ids), device)
        rows.append(
            {"context": context, "method": run, "ttft_s": prefill_s + answer_s, "prefill_or_load_s": prefill_s}
            | peak(device)
        )
        log(rows[-1])
        if not path.exists():
            sizes["save_s"], _ = timed(lambda d=doc: d.save_prefix(path), device)
            report = doc.memory_report()
            sizes |= {"file_bytes": path.stat().st_size, "host_bytes": report.host_bytes, "gpu_bytes": report.gpu_bytes}
            log(f"saved {sizes['file_bytes'] / GiB:.2f} GiB in {sizes['save_s']:.1f} s")
        del doc

    for run in ("loaded prefix (file on disk)", "loaded prefix (file in page cache)"):
        free(device)
        reset_peak(device)
        if "disk" in run:
            evict_from_page_cache(path)
        load_s, loaded = timed(lambda: ShadowKVCache.load_prefix(model, path, **settings_at_load(settings)), device)
        answer_s, _ = timed(lambda c=loaded: first_token(model, c, ids), device)
        rows.append(
            {
                "context": context,
                "method": run,
                "ttft_s": load_s + answer_s,
                "prefill_or_load_s": load_s,
                "load_gb_s": sizes["file_bytes"] / load_s / 1e9,
            }
            | peak(device)
        )
        log(rows[-1])
        del loaded
    for row in rows:
        row |= {"file_gib": sizes["file_bytes"] / GiB, "save_s": sizes["save_s"]}
    return rows, sizes


def settings_at_load(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k in ("sparse_budget", "pin_memory")}


def memory_rows(model, context: int, sizes: dict, batch: int, device) -> list[dict]:
    """Host memory for N questions, shared against separate; the largest N of each; a real shared batch."""
    path, document = sizes["path"], sizes["document"]
    host_doc = sizes["host_bytes"]
    free(device)
    doc = ShadowKVCache.load_prefix(model, path)
    one, two = doc.fork(1).memory_report(), doc.fork(2).memory_report()
    per_question_gpu = two.gpu_bytes - one.gpu_bytes  # temporal cache (question tokens come on top)
    rows = []
    for n in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, batch}):
        for layout, copies in (("shared", 1), ("separate", n)):
            rows.append(
                {
                    "context": context,
                    "questions": n,
                    "layout": layout,
                    "series": f"{layout}, {context // 1024}K",
                    "host_gib": copies * host_doc / GiB,
                    "fits_host": copies * host_doc <= HOST_RAM,
                }
            )
    summary = {
        "context": context,
        "host_doc_gib": host_doc / GiB,
        "max_separate_by_host": HOST_RAM // host_doc,
        "max_shared_by_host": "unbounded (one copy)" if host_doc <= HOST_RAM else 0,
        "gpu_per_question_gib": per_question_gpu / GiB,
    }
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        summary["max_shared_by_gpu"] = int(free_bytes // per_question_gpu)

    # A real shared batch: N questions of different lengths over the one loaded document.
    gen = torch.Generator().manual_seed(1)
    questions = [torch.randint(10, model.config.vocab_size, (QUESTION - i % 8,), generator=gen) for i in range(batch)]
    ids, mask = batch_questions(document, questions, pad_token_id=0)
    rss_before = host_rss()
    reset_peak(device)
    cache = doc.fork(batch)
    ttft, _ = timed(lambda c=cache: first_token(model, c, ids.to(device), mask.to(device)), device)
    summary |= {
        "ran_shared_batch": batch,
        "shared_batch_ttft_s": ttft,
        "shared_batch_host_rss_delta_gib": (host_rss() - rss_before) / GiB,
        "shared_batch_host_store_gib": cache.memory_report().host_bytes / GiB,
    }
    summary |= {f"shared_batch_{k}": v for k, v in peak(device).items()}
    del cache
    # Two separate copies (two loads): what one more question costs in host memory without sharing.
    free(device)
    rss_before = host_rss()
    copies = [ShadowKVCache.load_prefix(model, path) for _ in range(2)]
    summary["two_separate_host_store_gib"] = sum(c.memory_report().host_bytes for c in copies) / GiB
    summary["two_separate_host_rss_delta_gib"] = (host_rss() - rss_before) / GiB
    del copies, doc
    log(summary)
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny random model and contexts (checks the script)")
    parser.add_argument("--contexts", type=int, nargs="+", help="default: 32768 131072 (small: 2048 4096)")
    parser.add_argument("--batch", type=int, help="questions in the shared batch that is run (default 64; small 8)")
    parser.add_argument("--dir", type=Path, help="where prefix files are written (deleted after)")
    add_results_dir_option(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    contexts = args.contexts or ([2048, 4096] if args.small else [32768, 131072])
    batch = args.batch or (8 if args.small else 64)
    # The paper's defaults (scaled to the prompt); small: compress the short contexts too.
    settings = {**PAPER_SETTINGS, **({"min_compress_len": 1024} if args.small else {})}
    name = f"prefix_reuse_{device.type}" + ("_small" if args.small else "")

    model = build_model(args.small, device)
    log(f"model built on {device}; contexts {contexts}, shared batch {batch}")
    # Warm-up: kernels, cuBLAS handles, the attention registration.
    warm_ids = torch.randint(10, model.config.vocab_size, (1040,), generator=torch.Generator().manual_seed(0))
    warm = ShadowKVCache.prefill(model, warm_ids[:1024], min_compress_len=512)
    first_token(model, warm.fork(), warm_ids[None].to(device))
    del warm

    ttft, memory, batches = previous_rows(name, contexts)
    (args.dir or results_dir()).mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=".prefix_reuse.", dir=args.dir or results_dir()))
    try:
        for context in contexts:
            rows, sizes = ttft_rows(model, context, settings, device, directory)
            ttft += rows
            rows, summary = memory_rows(model, context, sizes, batch, device)
            memory += rows
            batches.append(summary)
            sizes["path"].unlink()
            write(name, ttft, memory, batches, device)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def previous_rows(name: str, contexts: list[int]) -> list[list[dict]]:
    """Rows of earlier runs at other contexts, so that one context per command accumulates one table."""
    out = []
    for suffix in ("", "_memory", "_batch"):
        try:
            rows = json.loads((results_dir() / f"{name}{suffix}.json").read_text())["rows"]
        except (OSError, ValueError, KeyError):
            rows = []
        out.append([r for r in rows if r.get("context") not in contexts])
    return out


def write(name: str, ttft: list[dict], memory: list[dict], batches: list[dict], device) -> None:
    env = environment(str(device), "bfloat16" if device.type == "cuda" else "float32")
    write_results(
        name,
        "Prefix reuse: time to first token, fresh prefill vs loaded prefix (Llama-3.1-8B shape, random weights)",
        env,
        ttft,
        ["context", "method", "ttft_s", "prefill_or_load_s", "file_gib", "load_gb_s", "save_s", "peak_gpu_gib"],
        {"x": "file_gib", "y": "prefill_or_load_s", "series": "method", "ylabel": "prefill or load time (s)"},
    )
    write_results(
        name + "_memory",
        f"Host memory for the values of N questions over one document, shared vs separate ({HOST_RAM // GiB} GiB)",
        env,
        memory,
        ["context", "questions", "layout", "host_gib", "fits_host"],
        {"x": "questions", "y": "host_gib", "series": "series", "ylabel": "host memory for values (GiB)"},
    )
    write_results(
        name + "_batch",
        "Largest batch of questions over one document, and a shared batch run",
        env,
        batches,
        [
            "context",
            "host_doc_gib",
            "max_separate_by_host",
            "max_shared_by_host",
            "gpu_per_question_gib",
            "max_shared_by_gpu",
            "ran_shared_batch",
            "shared_batch_ttft_s",
            "shared_batch_peak_gpu_gib",
            "shared_batch_host_rss_delta_gib",
            "shared_batch_host_store_gib",
            "two_separate_host_store_gib",
            "two_separate_host_rss_delta_gib",
        ],  # fmt: skip
        None,
    )


if __name__ == "__main__":
    main()
