"""Benchmarks that print comparable tables; run on purpose, never from the test suite."""

import phalanx  # noqa: F401 - first: it turns gRPC fork support off before grpc loads
