"""The head's side of the process boundary, by job: the multi-process executor proper (`mp_executor`),
stage supervision (`supervision`: spawn, accept, ports, how a stage ended, stop) and the start-up
handshake and sizing (`startup`). No jax: the head of a multi-process pipeline holds no device. What it
shares with the stage processes (wire format, cluster addresses, trace) is `jaxcpp.pipe`."""
