"""The fleet: requests routed over tensor-parallel worker groups, handed off and moved on failure (see DESIGN.md)."""
