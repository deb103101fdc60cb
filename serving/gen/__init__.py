"""Generated protobuf/gRPC code (regenerate with `python -m jaxcpp.serving.codegen`)."""
