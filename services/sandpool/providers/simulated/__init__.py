"""The simulating provider (`--provider simulated`): sandboxes that exist only as records.

A benchmark and test tool for the control plane at scale (docs/capacity.md), never a way to
run code: one server process answers the agent protocol for every simulated sandbox.
"""
