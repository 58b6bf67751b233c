"""radixserve: a prefix-caching LLM serving runtime built around RadixAttention."""

__version__ = "0.1.0"
