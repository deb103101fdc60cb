"""What a model name stands for, read without touching the weights (host side, no jax).

    spec = resolve_model_spec("tiny" | "/path/to/hf-folder" | "/path/to/orbax-folder", dtype="auto")
    spec.config      # LlamaConfig, with the dtype the engine will run in
    spec.tokenizer   # or None: the folder has none, so requests must send token ids
    spec.format      # "orbax" (jaxcpp's params/ folder) or "hf" (safetensors)

The engine's head sizes everything from the spec (max model length, pages, buckets); each pipeline stage
then loads only its own layers from `spec.folder` (`jaxcpp.models.checkpoint.load_stage_params`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from jaxcpp.errors import ModelLoadError
from jaxcpp.models.config import DTYPES, LlamaConfig
from jaxcpp.tokenizer import Tokenizer, load_tokenizer

BUNDLED_MODELS = {"tiny": Path(__file__).resolve().parent / "checkpoints" / "tiny"}
ORBAX_PARAMS_DIR = "params"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    folder: Path
    config: LlamaConfig
    tokenizer: Tokenizer | None
    format: str  # "orbax" | "hf"

    def with_dtype(self, dtype: str | None) -> ModelSpec:
        """The spec with the dtype the engine runs in (None or "auto": the checkpoint's)."""
        if dtype in (None, "auto"):
            return self
        if dtype not in DTYPES:
            raise ModelLoadError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        return dataclasses.replace(self, config=self.config.replace(dtype=dtype))

    @property
    def stored_dtype(self) -> str:
        """The dtype an orbax folder's arrays were saved in (config.json's, before any --dtype)."""
        return LlamaConfig.from_pretrained(self.folder).dtype


def model_folder(name_or_path: str | Path) -> Path:
    folder = BUNDLED_MODELS.get(str(name_or_path), Path(name_or_path))
    if not folder.is_dir():
        raise ModelLoadError(f"{name_or_path}: neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
                             "nor an existing folder")
    return folder.resolve()


def resolve_model_spec(name_or_path: str | Path, dtype: str | None = "auto") -> ModelSpec:
    """'tiny' (bundled), an orbax folder from `save_orbax`, or a Hugging Face folder."""
    folder = model_folder(name_or_path)
    config = LlamaConfig.from_pretrained(folder)
    fmt = "orbax" if (folder / ORBAX_PARAMS_DIR).is_dir() else "hf"
    return ModelSpec(str(name_or_path), folder, config, load_tokenizer(folder, config), fmt).with_dtype(dtype)
