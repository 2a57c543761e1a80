"""The token-in-token-out check both rollout suites make (the HF one in tests/agent_env/test_rollout.py
and the engine one in engine_checks.py, run as a script in .venv-vllm or .venv-sglang, which imports this file as its
sibling): the rollout's log-probs against an HF forward over the collated batch."""

from __future__ import annotations

from typing import Any


def recomputed_at_real_turns(model: Any, batch: Any, trajs: list, real: set, temperature: float):
    """``(recomputed, sel)``: log_softmax(logits / T) of each response token from one forward of
    ``model`` over the collated batch (left-padded prompts, masks, position ids), and the positions
    to compare: policy tokens (mask 1) of turns whose context the engine really saw (``real``: the
    token-id prefixes it was given)."""
    import torch

    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits.float()
    P = batch["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : -1] / temperature, dim=-1)
    recomputed = lp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()
    real_positions = torch.zeros_like(mask)
    for i, t in enumerate(trajs):
        for turn in t.turns:
            if tuple(t.prompt_ids + t.response_ids[: turn.start]) in real:
                real_positions[i, turn.start : turn.end] = True
    return recomputed, mask & real_positions
