"""One entry point over the chunking policies: "fixed", "equal-latency" (ATOM's rule) and "optimal".

    next_chunk_size(policy, model, prompt_len, num_computed_tokens, budget_left, settings)  # one step
    plan_chunks(policy, prompt_len, settings, model, fit_error=0.0)                         # a prompt

Both are stateless (`optimal` replans the rest of the prompt on every call; the controller caches its
plans). They sit above planner.py and optimal.py so that neither of those imports the other's caller.
"""

from __future__ import annotations

from jaxcpp.chunking.latency_model import LatencyModel
from jaxcpp.chunking.optimal import plan_optimal
from jaxcpp.chunking.planner import ChunkSettings, equal_latency_chunk, fit_budget, plan_equal_latency, plan_fixed

POLICIES = ("fixed", "equal-latency", "optimal")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown chunking policy {policy!r}; expected one of {', '.join(POLICIES)}")


def next_chunk_size(policy: str, model: LatencyModel | None, prompt_len: int, num_computed_tokens: int,
                    budget_left: int, settings: ChunkSettings) -> int:
    """The chunk to schedule now for a prompt with `num_computed_tokens` already scheduled."""
    check_policy(policy)
    remaining = prompt_len - num_computed_tokens
    if remaining <= 0 or budget_left <= 0:
        return 0
    if policy == "fixed" or model is None:
        return min(settings.budget, budget_left, remaining)
    if policy == "equal-latency":
        return min(equal_latency_chunk(model, num_computed_tokens, budget_left, settings).size, remaining)
    first = plan_optimal(model, prompt_len, settings, start=num_computed_tokens)[0]
    return fit_budget(first, budget_left, remaining, settings)


def plan_chunks(policy: str, prompt_len: int, settings: ChunkSettings,
                model: LatencyModel | None = None, start: int = 0, fit_error: float = 0.0) -> list[int]:
    """Every chunk of one prompt, prefilled alone with the full budget each step (`fit_error`: the
    installed model's, which `optimal` trusts it to; see `plan_optimal`'s margin)."""
    check_policy(policy)
    if policy == "fixed" or model is None:
        return plan_fixed(prompt_len, settings.budget, start)
    if policy == "optimal":
        return plan_optimal(model, prompt_len, settings, start=start, margin=fit_error)
    return plan_equal_latency(prompt_len, settings, model, start)
