"""Plumbing every service shares: settings, named errors, structured logs."""
