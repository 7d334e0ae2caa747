"""The benchmarks, one package per area; benchmarks/README.md is the index."""
