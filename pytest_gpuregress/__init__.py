"""pytest-gpuregress: regression tests for the numerics of a training stack."""

__version__ = "0.1.0"
