"""Engine upstreams that speak vLLM's KV event protocol: re-keying, ordering, subscribing."""
