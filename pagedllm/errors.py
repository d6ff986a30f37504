"""Typed errors: validation raises these with a message naming what is wrong."""


class PagedLLMError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequestError(PagedLLMError, ValueError):
    """A request the engine refuses (bad prompt, bad parameters, cannot fit)."""


class ModelLoadError(PagedLLMError):
    """A model folder or file that cannot be loaded."""


class ConfigError(PagedLLMError, ValueError):
    """An engine option that is out of range or inconsistent."""


class RequestFailedError(PagedLLMError):
    """A request that failed inside an engine step: it was aborted alone, its blocks freed."""
