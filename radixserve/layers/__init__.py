"""Building blocks of the model's forward pass, below ``models/`` and ``worker/``:
``linear.py`` (the linear layer and its CPU product forms), ``parallel.py`` (tensor
parallelism's collectives and sharded layers) and ``cpu_kernels.py`` (the native CPU
kernels' Python side). Imports nothing from radixserve above it."""
