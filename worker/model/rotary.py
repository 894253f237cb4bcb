"""Rotary position embedding tables, including Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from worker.model.arch import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair inverse frequencies (float32), as HF transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int,
                  device: torch.device | str) -> torch.Tensor:
    """(max_positions, head_dim) float32: cos of every pair frequency, then sin (flashinfer's layout)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
