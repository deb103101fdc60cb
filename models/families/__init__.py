"""The model families jaxcpp loads, by `architectures[0]`; adding one is a file here plus its tests
(docs/models.md, "Adding a family")."""

from jaxcpp.models.families.base import Family
from jaxcpp.models.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from jaxcpp.models.families.llama import LLAMA, MISTRAL, QWEN2
from jaxcpp.models.families.mixtral import MIXTRAL
from jaxcpp.models.families.qwen2_moe import QWEN2_MOE
from jaxcpp.models.families.qwen3 import QWEN3, QWEN3_MOE

FAMILIES: dict[str, Family] = {f.architecture: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, QWEN2_MOE,
                                                                  DEEPSEEK_V2, DEEPSEEK_V3)}

__all__ = ["FAMILIES", "Family"]
