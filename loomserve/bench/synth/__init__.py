"""`loomserve bench synth`: generate Weka-format traces whose statistics match a target profile.

    profiles.py   `Dist`, `SynthProfile` and the shipped profiles (agentx, weka-small, cpu)
    generate.py   the session model: one session document per (profile, seed, index)
    targets.py    measured statistics against the profile's target figures
    cli.py        options and `main`

Reproducible: session i is drawn from (seed, i) regardless of N, and the same seed writes
byte-identical files. Every public name is importable from here.
"""

from loomserve.bench.synth.cli import add_arguments, main
from loomserve.bench.synth.generate import generate_session_doc, generate_sessions, write_traces
from loomserve.bench.synth.profiles import AGENTX, CPU, PROFILES, WEKA_SMALL, D, Dist, SynthProfile
from loomserve.bench.synth.targets import compare, format_compare

__all__ = ["Dist", "SynthProfile", "PROFILES", "generate_session_doc", "generate_sessions",
           "write_traces", "compare", "add_arguments", "main", "D", "AGENTX", "WEKA_SMALL", "CPU",
           "format_compare"]
