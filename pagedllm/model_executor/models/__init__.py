"""Model files (one per family), their weight-name maps and the registry that finds them."""

from .config import ModelConfig
from .registry import ModelEntry, ModelRegistry, default_registry

__all__ = ["ModelConfig", "ModelEntry", "ModelRegistry", "default_registry"]
