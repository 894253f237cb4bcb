"""Attention backends behind one plan/run interface."""
