"""The worker: model weights, KV page pool, attention backend and sampler."""
