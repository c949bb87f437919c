"""Peer KV fetch, one subsystem in one place (docs/fetch.md).

- ``client``: the asker. On a prefix-cache miss, finds a peer holding more of the prompt's
  blocks (the router's hint, else the Redis map), weighs transfer against prefill, and pulls.
- ``holder``: ``Replica.FetchBlocks``, the holder's side: streams pinned blocks to a peer.
- ``layout``: ``KVLayout``, what must match between two replicas for blocks to move.
- ``transfer``: the engine's side of a transfer (pinned blocks out, fetched blocks in, the
  salt's hash chain checked); torch only, the one module of this package the engine imports.
- ``warm_start``: a joining replica pre-fetches the blocks most peers hold.

The asker asks the engine (``LLMEngine.prompt_block_hashes``, ``cached_prefix_blocks``,
``pin_prefix``, ``import_blocks``), never its block manager.
"""
