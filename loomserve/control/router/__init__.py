"""`loomserve router`: a session- and KV-aware HTTP front for N instances.

Modules, one concept each: kv_index (which instance caches which block, from KV events),
instances (the instance set: /info, health checks, load accounting, event subscribers),
tokens (a request's prompt ids and block hashes, as the instances compute them, memoized per
session), policies (round_robin, least_loaded, session, kv_aware, default), pd (when to
disaggregate prefill and decode, and the handshake's bodies), routing (the decision for one
request), proxy (relaying to an instance, failures in the API's shape), metrics, app (the
FastAPI routes), cli (`loomserve router`). Imports nothing from loomserve.execution but
its torch-free hub resolver (models/loading/hub.py: a --tokenizer hub id).
"""
