"""Benchmarks (not tests). The scenarios (serving, stall, multiturn, structured, routing, soak) run
servers through one harness: bench/servers.py starts and measures them, bench/harness.py reads
their streams and writes results and reports, bench/provenance.py says where they ran.
bench/studies/ holds the single-decision studies (bench/studies/README.md)."""
