"""A model-agnostic CUDA-graph runtime: runners own shapes and buffers, backends own capture.

See ``graphs/DESIGN.md`` for the invariants (static addresses, break boundaries, stream joins,
one pool and one capture stream per process).
"""
