"""Moving KV pages (and EPD image embeddings) between engine processes.

- `wire`: framing on the built-in TCP transport.
- `states`: the per-transfer poll states (Failed, Bootstrapping, WaitingForInput, Transferring,
  Success) and the table that exposes them.
- `server`: the TCP side channel every engine listens on.
- `push`: the source writes into a destination the sink reserved and registered first
  (SGLang bootstrap rooms and vLLM Mooncake transfer ids).
- `pull`: the source holds pages under a lease until the sink reads them (vLLM NIXL).
- `bootstrap`: the prefill's bootstrap HTTP server (`/route`, `/register`, `/query`).
- `kvio`: sending pages (TCP frames or an optional data plane) and receiving them, checked.
- `mooncake_te`, `nixl_dp`: the optional data planes; `regions`: the contiguous byte regions of
  the page-major pool that they write.
- `embed`: EPD image embeddings from an encode worker to a prefill (the same side channel);
  `embed_plane`: their optional Mooncake TE data plane, a staging area of pre-registered slots.
"""
