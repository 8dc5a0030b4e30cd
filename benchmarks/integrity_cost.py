"""What a prefix file's checks cost on this machine: hashing the model identity, and each tensor's digest.

1. Model identity (prefix/identity.py): SHA-256 over the input embeddings and every parameter of the decoder layers,
   on a model of the Llama-3.1-8B shape with random weights. `--layers` builds fewer layers than 32 when memory is
   short (the full model is 16 GB in bf16); the cost is then extrapolated to 32 layers from the bytes per second
   measured, and the result says so.
2. Tensor digests and the finiteness check (prefix/integrity.py) per GiB, on random bf16 host tensors.
3. Optionally (`--prefix-tokens N`), `load_prefix` of a real SmolLM2 prefix of N tokens with `verify=True` against
   `verify=False` (the page cache warm for both).

    OMP_NUM_THREADS=1 python -m benchmarks.integrity_cost --layers 2 --prefix-tokens 8192 --results-dir /tmp/results
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results_io import environment, markdown_table
from shadowkv_cache.prefix import integrity
from shadowkv_cache.prefix.identity import forget_model_identity, identity_weights, model_identity

LLAMA_31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def identity_cost(layers: int) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(num_hidden_layers=layers, **LLAMA_31_8B)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()  # random weights, built in bf16
    built = time.perf_counter() - start
    hashed = sum(p.numel() * p.element_size() for _, p in identity_weights(model))
    forget_model_identity(model)
    start = time.perf_counter()
    model_identity(model)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model_identity(model)
    kept = time.perf_counter() - start
    embed = model.get_input_embeddings().weight
    per_layer = (hashed - embed.numel() * embed.element_size()) / layers
    full = embed.numel() * embed.element_size() + 32 * per_layer
    rate = hashed / first
    return {
        "what": f"model identity, Llama-3.1-8B shape, {layers} of 32 layers, bf16",
        "bytes": hashed,
        "seconds": round(first, 3),
        "GB/s": round(rate / 1e9, 3),
        "kept identity (s)": round(kept, 6),
        "32 layers, extrapolated bytes": int(full),
        "32 layers, extrapolated seconds": round(full / rate, 2),
        "build (s)": round(built, 1),
    }


def digest_cost(gib: float) -> list[dict]:
    n = int(gib * 2**30 / 2)
    tensor = torch.randn(n, dtype=torch.float32).to(torch.bfloat16)
    pieces = {str(i): piece for i, piece in enumerate(tensor.chunk(8))}
    rows = []
    for what, run in (  # one core each, but the pieces
        ("SHA-256 digest", lambda: integrity.tensor_digest(None, "0" * 64, "x", tensor)),
        ("HMAC-SHA256 digest", lambda: integrity.tensor_digest(b"k" * 32, "0" * 64, "x", tensor)),
        ("SHA-256 digests of 8 pieces, all cores", lambda: integrity.tensor_digests(None, "0" * 64, pieces)),
        ("finite check (aminmax)", lambda: integrity.non_finite(tensor)),
    ):
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        rows.append({"what": what, "bytes": 2 * n, "seconds": round(seconds, 3), "s per GiB": round(seconds / gib, 3),
                     "GB/s": round(2 * n / seconds / 1e9, 3)})  # fmt: skip
    return rows


def load_cost(tokens: int) -> list[dict]:
    from shadowkv_cache import ShadowKVCache
    from shadowkv_cache.embedded_models import load_smollm2
    from shadowkv_cache.fidelity import natural_text_ids

    model, tokenizer = load_smollm2(dtype=torch.float32, device="cpu")
    ids = natural_text_ids(tokenizer, tokens)[0]
    doc = ShadowKVCache.prefill(model, ids, min_compress_len=1024)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "doc.safetensors"
        start = time.perf_counter()
        doc.save_prefix(path)
        save = time.perf_counter() - start
        size = path.stat().st_size
        ShadowKVCache.load_prefix(model, path)  # page cache and identity warm
        for verify in (True, False):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                ShadowKVCache.load_prefix(model, path, verify=verify)
                best = min(best, time.perf_counter() - start)
            rows.append({"what": f"load_prefix verify={verify}, SmolLM2 fp32, {tokens} tokens", "bytes": size,
                         "seconds": round(best, 3)})  # fmt: skip
    extra = rows[0]["seconds"] - rows[1]["seconds"]
    rows.append({"what": "verification (difference)", "bytes": size, "seconds": round(extra, 3),
                 "s per GiB": round(extra / (size / 2**30), 3)})  # fmt: skip
    rows.append({"what": "save_prefix (digests included)", "bytes": size, "seconds": round(save, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B-shaped model (32 = full)")
    parser.add_argument("--digest-gib", type=float, default=1.0)
    parser.add_argument("--prefix-tokens", type=int, default=0, help="also time load_prefix on SmolLM2 (0: skip)")
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--name", default="integrity_cost_cpu")
    args = parser.parse_args()
    rows = [identity_cost(args.layers)] + digest_cost(args.digest_gib)
    if args.prefix_tokens:
        rows += load_cost(args.prefix_tokens)
    for row in rows:
        print(row, flush=True)
    env = environment("cpu", "bfloat16")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    columns = ["what", "bytes", "seconds", "GB/s", "s per GiB", "32 layers, extrapolated seconds", "kept identity (s)"]
    lines = ["# Cost of the prefix-file checks (CPU)", ""] + markdown_table(rows, columns)
    lines += ["", "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items() if k != "command"), ""]
    (args.results_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
