"""specray: lossless speculative decoding with multi-level cascades, served on Ray Serve."""

__version__ = "0.1.0"
