"""Ray actors hosting tensor-parallel worker groups (see cluster/DESIGN.md)."""
