"""Speculative decoding: drafting tokens cheaply and verifying them in one target forward.

    params.py       SpeculativeParams (carried by SamplingParams)
    ngram.py        prompt-lookup drafter
    draft_model.py  small-model drafter over its own paged KV cache
    verify.py       greedy verification and speculative rejection sampling

Only params is imported here, so `kog.sampling_params` does not pull in torch.
See docs/STRUCTURED.md.
"""

from kog.speculation.params import SpeculativeParams

__all__ = ["SpeculativeParams"]
