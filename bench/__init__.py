"""Benchmarks that print comparable tables; run on purpose, never from the test suite."""
