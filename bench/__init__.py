"""Benchmarks (run on a GPU machine); each writes JSON to bench/results/."""
