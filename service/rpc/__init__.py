"""gRPC plumbing shared by the gRPC protocol adapters: handler rewrapping, interceptors, auth, drain, streams."""
