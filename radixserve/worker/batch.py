"""What the scheduler asks the worker to compute in one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from radixserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ReqStep:
    """One request's share of a step.

    slot: the request's slot (its page table and sampling state live there).
    input_ids: int32 tokens to compute now, at absolute positions
    ``start_pos .. start_pos + len(input_ids) - 1``.
    start_pos: number of tokens already in the KV pool for this slot (cached
    prefix included).
    new_pages: int32 page ids appended to the slot's page table since its last
    step; a slot's first step carries its whole table so far (cached-prefix
    pages included). After appending, the table must cover
    ``start_pos + len(input_ids)`` tokens.
    sample: whether to sample a token after this step (False for non-final
    prefill chunks).
    sampling: given in the step that adds the slot; remembered until released.
    """

    slot: int
    input_ids: np.ndarray
    start_pos: int
    new_pages: np.ndarray
    sample: bool = True
    sampling: SamplingParams | None = None


@dataclass
class StepBatch:
    """A step: ``release`` slots are cleared first, then ``reqs`` run, in order."""

    reqs: list[ReqStep]
    release: list[int] = field(default_factory=list)
