"""Tests of the control plane (loomserve.control)."""
