"""Sampling: validated per-request parameters and a batched, host-sync-free device sampler.

``SamplingParams`` / ``SamplingParamsError`` import without torch; the sampler names
(``SamplingBatch``, ``SampleOutput``, ``sample``) load ``worker.sampling.sampler`` on first use.
"""

from worker.sampling.params import GREEDY_EPS, SamplingParams, SamplingParamsError

__all__ = ["GREEDY_EPS", "SampleOutput", "SamplingBatch", "SamplingParams", "SamplingParamsError", "sample"]

_SAMPLER_NAMES = frozenset({"SampleOutput", "SamplingBatch", "sample"})


def __getattr__(name: str):
    if name in _SAMPLER_NAMES:
        from worker.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
