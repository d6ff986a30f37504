"""Sampling: the sampler and structured outputs (grammars)."""
