"""The Open Inference Protocol (KServe v2, with Triton's extensions): the model's tensors (tensors.py), the
gRPC codec (codec.py), model metadata and configuration (model.py), and the gRPC servicer (servicer.py)."""
