"""What both sides of the process boundary share, owned by neither: the control channel's wire format
(`wire`), the cluster's addresses and control key (`cluster`), the Chrome/Perfetto trace (`trace`). The
head (`jaxcpp.head`) and the device side (`jaxcpp.runtime`) import these; this package imports neither,
and no jax."""
