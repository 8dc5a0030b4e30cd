"""The only part that knows Transformers: model adapters and patching, the registered attention function, the cache
and its layers, decode graphs, prefill runs and micro-batching."""
