"""Control plane: what runs where across instances.

router/ (`loomserve router`: session- and KV-aware placement, prefill/decode disaggregation, the
HTTP proxy), kv_events.py (the subscriber to instances' KV events), cluster/ (`loomserve
cluster`: instances and the router from flags or YAML) and store_launcher.py (`loomserve store`:
the shared Mooncake or Redis pool). Talks to instances over HTTP and KV events only; below it,
it uses pure pieces (the API's chat layer, the tokenizer wrapper, kv.hashing, kv.event_wire),
never an engine core or a worker. Design: docs/design/router.md.
"""
