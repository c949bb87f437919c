"""prefixmesh: a multi-replica LLM serving cluster with a KV-cache-aware router.

Its root is the torch-free library shared by router, replica and load tester (block hashing,
the Redis layout, the tokenizer, stop strings, API keys, settings, request defaults, the event
loop runner, child-process supervision and the embedded ``redis-server``);
``prefixmesh.openai`` is the OpenAI HTTP front door and ``prefixmesh.cli`` the
``prefixmesh`` command line, the one room on top of everything (nothing imports it).
docs/design.md has the map of what may import what.
"""

__version__ = "0.1.0"
