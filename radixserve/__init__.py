"""radixserve: a prefix-caching LLM serving runtime built around RadixAttention.

``import radixserve`` stays light (no torch): ``Engine`` is imported on first use.
"""

from radixserve.results import Result, Usage
from radixserve.sampling_params import SamplingParams, StructuredOutput
from radixserve.version import __version__

__all__ = ["Engine", "Result", "SamplingParams", "StructuredOutput", "Usage", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
