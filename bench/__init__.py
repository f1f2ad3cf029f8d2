"""Benchmark scripts (not tests): ShareGPT loading, throughput, splitting, scheduler overhead."""
