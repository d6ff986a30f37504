from .llama import LlamaForCausalLM, ModelConfig

__all__ = ["LlamaForCausalLM", "ModelConfig"]
