"""Model code: config, rotary, the shared decoder blocks (dense and MoE), checkpoint names, loading."""
