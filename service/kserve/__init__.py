"""The Open Inference Protocol (KServe v2, with Triton's extensions): the model's tensors, decoded and checked
for both wires (tensors.py), the gRPC codec (codec.py), model metadata, configuration and readiness
(model.py), the gRPC servicer (servicer.py) and the REST routes (rest.py)."""
