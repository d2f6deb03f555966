"""Model definitions and loading: Hugging Face directories, GGUF files, the bundled default."""

from vivace.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from vivace.models.loader import LoadedModel, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelConfig", "load_model"]
