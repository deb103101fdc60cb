"""gRPC serving: proto, server, client stubs and the `jaxcpp` CLI. Never imports jax directly."""
