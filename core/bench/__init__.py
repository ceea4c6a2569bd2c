"""Benchmarks: fdx bench throughput | serve | prefix."""
