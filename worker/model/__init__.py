"""Llama-family decoders built from HF checkpoints."""
