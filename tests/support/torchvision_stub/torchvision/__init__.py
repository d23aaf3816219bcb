"""A stand-in for torchvision, for SGLang's argument parser on a CPU torch only (see README.md):
the names SGLang and transformers import at module level, no image operation."""

from torchvision import io, transforms  # noqa: F401

# torch 2.13's torchvision; the local label says what this is.
__version__ = "0.28.0+stub"
