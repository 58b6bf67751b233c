"""The scheduler: cache metadata (radix tree, page allocator) and batching.

This package never imports torch: it is pure bookkeeping over page ids.
"""
