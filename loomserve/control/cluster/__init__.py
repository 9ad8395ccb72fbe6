"""`loomserve cluster`: instances and the router on one machine, or a node's share of them.

spec.py reads the cluster (YAML or flags) into commands; supervisor.py runs and watches the
processes; cli.py is the subcommand. Talks to instances over HTTP only.
"""

from loomserve.control.cluster.cli import add_cluster_parser, run_cluster
from loomserve.control.cluster.spec import ClusterSpec, SpecError, load_spec

__all__ = ["add_cluster_parser", "run_cluster", "ClusterSpec", "SpecError", "load_spec"]
