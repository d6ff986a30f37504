"""Architecture name (config.json's `architectures[0]`) -> model class, imported only when used.

Adding an architecture is a model file plus one line in `_BUILTIN`. A GGUF file names its
architecture in `general.architecture`; `gguf` maps that name to the HF one. Code outside the
package (a plugin, a test) registers its own classes on a `ModelRegistry` and passes it to the loader,
so nothing global changes under anyone's feet.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ...errors import ModelLoadError


@dataclass(frozen=True)
class ModelEntry:
    target: str | type  # "module:Class" relative to this package, or the class itself
    gguf: str | None = None  # the GGUF `general.architecture` this architecture is stored under
    # the GGUF names it only with `{arch}.expert_count` set (Mixtral is `llama` so); None: with it or without
    gguf_experts: bool | None = False
    model_type: str | None = None  # config.json's `model_type` in HF's checkpoints of it (an exported folder's)

    def load(self) -> type:
        if isinstance(self.target, type):
            return self.target
        module, name = self.target.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)


_BUILTIN: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama:LlamaForCausalLM", gguf="llama", model_type="llama"),
    "MistralForCausalLM": ModelEntry("llama:LlamaForCausalLM", gguf="mistral", model_type="mistral"),
    "Qwen2ForCausalLM": ModelEntry("qwen2:Qwen2ForCausalLM", gguf="qwen2", model_type="qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3:Qwen3ForCausalLM", gguf="qwen3", model_type="qwen3"),
    "Phi3ForCausalLM": ModelEntry("phi3:Phi3ForCausalLM", gguf="phi3", model_type="phi3"),
    "Gemma3ForCausalLM": ModelEntry("gemma3:Gemma3ForCausalLM", gguf="gemma3", model_type="gemma3_text"),
    "Gemma3ForConditionalGeneration": ModelEntry("gemma3:Gemma3TextTower"),
    "Gemma4ForCausalLM": ModelEntry("gemma4:Gemma4ForCausalLM", gguf="gemma4", gguf_experts=None,
                                    model_type="gemma4_text"),
    "Gemma4ForConditionalGeneration": ModelEntry("gemma4:Gemma4TextTower"),
    "MixtralForCausalLM": ModelEntry("mixtral:MixtralForCausalLM", gguf="llama", gguf_experts=True,
                                     model_type="mixtral"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe:Qwen3MoeForCausalLM", gguf="qwen3moe", gguf_experts=True,
                                      model_type="qwen3_moe"),
    "OlmoeForCausalLM": ModelEntry("olmoe:OlmoeForCausalLM", gguf="olmoe", gguf_experts=True, model_type="olmoe"),
    "GptOssForCausalLM": ModelEntry("gpt_oss:GptOssForCausalLM", gguf="gpt-oss", gguf_experts=True,
                                    model_type="gpt_oss"),
    "Qwen3_5ForCausalLM": ModelEntry("qwen3_5:Qwen3_5ForCausalLM", gguf="qwen35", model_type="qwen3_5_text"),
    "Qwen3_5ForConditionalGeneration": ModelEntry("qwen3_5:Qwen3_5TextTower"),
    "Qwen3_5MoeForCausalLM": ModelEntry("qwen3_5:Qwen3_5ForCausalLM", gguf="qwen35moe", gguf_experts=True,
                                        model_type="qwen3_5_moe_text"),
    "Qwen3_5MoeForConditionalGeneration": ModelEntry("qwen3_5:Qwen3_5TextTower"),
}


class ModelRegistry:
    def __init__(self, entries: dict[str, ModelEntry] | None = None) -> None:
        self._entries = dict(_BUILTIN if entries is None else entries)

    def register(self, architecture: str, target: str | type, gguf: str | None = None,
                 gguf_experts: bool | None = False, model_type: str | None = None) -> ModelRegistry:
        """Add (or replace) an architecture; returns self for chaining."""
        self._entries[architecture] = ModelEntry(target, gguf, gguf_experts, model_type)
        return self

    @property
    def architectures(self) -> list[str]:
        return sorted(self._entries)

    def model_class(self, architecture: str) -> type:
        entry = self._entries.get(architecture)
        if entry is None:
            raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {self.architectures}")
        return entry.load()

    def model_type(self, architecture: str) -> str:
        """HF's `model_type` for an architecture, for a config.json written out (an exported GGUF)."""
        entry = self._entries.get(architecture)
        if entry is None or entry.model_type is None:
            raise ModelLoadError(f"no HF model_type is known for architecture {architecture!r}")
        return entry.model_type

    def from_gguf(self, gguf_arch: str | None, experts: bool = False) -> str:
        """The HF architecture name a GGUF's `general.architecture` stands for (experts: the file sets
        `{arch}.expert_count`)."""
        for name, entry in self._entries.items():
            if entry.gguf is not None and entry.gguf == gguf_arch and entry.gguf_experts in (experts, None):
                return name
        known = sorted(e.gguf for e in self._entries.values() if e.gguf)
        raise ModelLoadError(f"GGUF architecture {gguf_arch!r} is not supported ({', '.join(known)})")


def default_registry() -> ModelRegistry:
    """The built-in architectures (a fresh registry each call: callers may add to theirs)."""
    return ModelRegistry()
