"""Benchmarks and real-data fixtures for uzip-serve."""
