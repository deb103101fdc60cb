"""jaxcpp: a JAX/XLA pipeline-parallel LLM inference engine for long-prompt prefill.

The public offline API (`LLM`, `SamplingParams`) is imported lazily so that host-only modules
(scheduler, page allocator, chunking) can be imported without pulling in jax.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "StructuredOutputs"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from jaxcpp.core.outputs import RequestOutput
    from jaxcpp.llm import LLM
    from jaxcpp.sampling_params import SamplingParams
    from jaxcpp.structured.constraint import StructuredOutputs


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from jaxcpp.llm import LLM

        return LLM
    if name == "SamplingParams":
        from jaxcpp.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from jaxcpp.structured.constraint import StructuredOutputs

        return StructuredOutputs
    if name == "RequestOutput":
        from jaxcpp.core.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'jaxcpp' has no attribute {name!r}")
