"""The scheduler: continuous batching with chunked prefill under a token budget and an optional
step-time budget.

scheduler.py (the step), waiting_queue.py (admission order and aging), preemption.py (the
victim), step_cost.py and step_budget.py (the learned cost model and the step's time target),
request.py (a request as the core sees it). Design: docs/design/scheduler.md.
"""
