"""The actor's forward + backward on padded rows and on packed rows (``actor.pack_rows``), in one process.

    .venv/bin/python benchmarks/bench_pack_rows.py                 # the built-in tiny policy, 16 rows
    .venv/bin/python benchmarks/bench_pack_rows.py --shape small --rows 32 --width 512

A micro-batch as the rollout lays it out (left-padded prompts, right-padded responses, trimmed to
its longest row as the actor trims it) goes through :func:`otb_tir.token_stats.token_stats_for_causal_lm`
and the backward of its log-probs, padded (``packed=False``) and packed (``packed=True``: the rows'
tokens first-fit into rows of the micro-batch's width). Two length mixes:

* ``even``: response lengths uniform over the budget (every row about as long as another: little
  padding to remove, few rows fit beside one another);
* ``long_tail``: one row at the budget, the others short (a few long answers among many short
  ones, as RL batches often are: most of a padded batch is padding);
* ``groups``: ``--group`` samples per prompt of ``--group-prompt`` tokens (a GRPO batch), packed
  plainly and packed with one copy of each prompt (``share_prompts``).

Prints, per mix, the share of padding in the padded batch, the columns each way, the median seconds
over ``--reps`` and the ratio padded / packed. The statistics are compared too (the largest
difference of the log-probs on real tokens; the tests hold them to 2e-5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from otb_tir.defaults.shapes import build_model
from otb_tir.token_stats import token_stats_for_causal_lm
from otb_tir.token_stats_packing import PackedRows, pack_rows, prompt_sharing_mask_dtype
from otb_tir.trainer.actor import trim_padding


def group_rows(n: int, group: int, prompt: int, budget: int, vocab: int, seed: int):
    """``n`` rows in groups of ``group`` samples of one prompt of ``prompt`` tokens (a GRPO batch; the
    built-in task's prompt with its tool schemas is ~150 tokens), responses up to half the budget."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(budget // 8, budget // 2 + 1, (n,), generator=g)
    ids = torch.randint(1, vocab, (n, prompt + budget), generator=g)
    for i in range(n):
        ids[i, :prompt] = ids[i - i % group, :prompt]  # the group's first sample's prompt
    mask = torch.zeros_like(ids)
    for i in range(n):
        mask[i, : prompt + int(resp[i])] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    lo, hi = trim_padding(mask, budget)
    return (ids * mask)[:, lo:hi], mask[:, lo:hi], pos[:, lo:hi], budget - (prompt + budget - hi)


def rows(mix: str, n: int, prompt: int, budget: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if mix == "even":
        resp = torch.randint(budget // 8, budget + 1, (n,), generator=g)
    else:
        resp = torch.randint(4, max(budget // 6, 5), (n,), generator=g)
        resp[0] = budget
    plen = torch.randint(prompt // 2, prompt + 1, (n,), generator=g)
    ids = torch.randint(1, vocab, (n, prompt + budget), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(n):
        mask[i, prompt - int(plen[i]) : prompt + int(resp[i])] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    lo, hi = trim_padding(mask, budget)  # as the actor trims a micro-batch
    return (ids * mask)[:, lo:hi], mask[:, lo:hi], pos[:, lo:hi], budget - (prompt + budget - hi)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--width", type=int, default=192, help="the response budget (tokens)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt in the 'groups' mix")
    ap.add_argument("--group-prompt", type=int, default=150, help="prompt tokens in the 'groups' mix")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    model = build_model(a.shape, torch.device("cpu"), torch.float32).train()
    vocab = model.get_output_embeddings().weight.shape[0]
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{a.shape} policy ({params / 1e6:.1f}M parameters), {a.rows} rows, prompt <= {a.prompt}, "
        f"response budget {a.width}, float32, {torch.get_num_threads()} torch threads, median of {a.reps}"
    )
    head = ("mix", "padding", "cols padded", "cols packed", "padded s", "packed s", "ratio")
    print(f"{head[0]:<10} {head[1]:>8} {head[2]:>12} {head[3]:>12} {head[4]:>9} {head[5]:>9} {head[6]:>6}")
    for mix in ("even", "long_tail", "groups"):
        if mix == "groups":
            ids, mask, pos, r = group_rows(a.rows, a.group, a.group_prompt, a.width, vocab, seed=1)
        else:
            ids, mask, pos, r = rows(mix, a.rows, a.prompt, a.width, vocab, seed=1)
        ways: dict[str, bool | PackedRows | None] = {
            "padded": False,
            "packed": pack_rows(ids, mask, pos, r),
            "packed, prompts shared": pack_rows(ids, mask, pos, r, share_prompts=prompt_sharing_mask_dtype(model)),
        }
        if ways["packed, prompts shared"].attention_mask is None:  # no prompt repeats: the same as "packed"
            del ways["packed, prompts shared"]
        assert all(w is not None for w in ways.values())
        real = mask[:, -r:].bool()
        times: dict[str, list[float]] = {k: [] for k in ways}
        out = {}
        for rep in range(a.reps + 1):  # the first of each is a warm-up
            for name, packed in ways.items():
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                st = token_stats_for_causal_lm(model, ids, mask, pos, r, packed=packed)
                (st.log_probs * real).sum().backward()
                if rep:
                    times[name].append(time.perf_counter() - t0)
                out[name] = st.log_probs.detach()
        pad = statistics.median(times["padded"])
        padding = 1 - float(mask.sum()) / mask.numel()
        for name in list(ways)[1:]:
            gap = float((out[name] - out["padded"]).abs()[real].max())
            t = statistics.median(times[name])
            label = mix if name == "packed" else "  shared"  # packed, one copy of each prompt
            print(
                f"{label:<10} {100 * padding:>7.0f}% {mask.numel():>12} {ways[name].tokens:>12} {pad:>9.3f} "
                f"{t:>9.3f} {pad / t:>5.2f}x   (log-prob gap {gap:.1e})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
