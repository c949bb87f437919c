"""prefixmesh: a multi-replica LLM serving cluster with a KV-cache-aware router.

This package holds the torch-free pieces shared by router and replica (block hashing, the Redis
layout, the tokenizer) and the ``prefixmesh`` command line.
"""

__version__ = "0.1.0"
