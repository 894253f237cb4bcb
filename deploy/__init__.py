"""Deployment: configuration and launch of graphfleet."""
