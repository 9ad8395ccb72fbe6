"""`loomserve bench`: agentic traces (trace.py, stats.py), their synthesis (synth/), closed-loop
replay against an endpoint (replay/, metrics.py, report.py), offline cache simulation
(simulate/, belady.py, hybrid_eval.py) and prefill/decode sizing (pd_profile/).
"""
