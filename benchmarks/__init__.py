"""The project's benchmarks, one script per question, run as modules from the repository root:

    python -m benchmarks.throughput --small        # e.g.; every script takes --help

Scripts share their helpers as modules of this package (`benchmarks.results_io`, `benchmarks.tasks`, ...) and build
caches through the public API and `shadowkv_cache.testing`, never through the package's internals. Results go to
`benchmarks/results/` (or `--results-dir`), each with the commit, command line and environment that produced it.
"""
