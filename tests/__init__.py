import phalanx  # noqa: F401 - first: it turns gRPC fork support off before grpc loads
