"""Control plane: what runs where across instances. Today only the launcher of the shared
KV store (`loomserve store`); the router, prefill/decode disaggregation and rate matching
arrive here (see README.md in this folder). Talks to instances over HTTP and KV events and
imports no engine internals.
router/: `loomserve router`, the session- and KV-aware HTTP front for N instances."""
