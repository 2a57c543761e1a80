"""The verl plugin, in a fresh process: verl's own ``compute_advantage`` returns our results.

A fresh interpreter is needed: the registry swap is process state, and the first half of the
check runs verl's original estimators through the same ``compute_advantage`` call.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.optional import need

need("verl")

SCRIPT = textwrap.dedent(r'''
    import json, sys
    import numpy as np, torch
    import otb_tir, otb_tir.advantage, otb_tir.verl
    assert "verl" not in sys.modules, "importing otb_tir must not import verl"

    from otb_tir.verl import plugin
    from verl.protocol import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage
    import otb_tir.advantage as ours

    NAMES = plugin.ESTIMATOR_NAMES
    reg = core_algos.ADV_ESTIMATOR_REGISTRY
    originals = {n: reg[n] for n in NAMES}
    assert not plugin.installed()

    def make_batch(seed, with_is):
        g = torch.Generator().manual_seed(seed)
        B, R = 14, 48
        mask = torch.zeros(B, R, dtype=torch.int64)
        for i in range(B):  # multi-turn rows: policy segments, tool segments (0), right padding
            pos, length = 0, int(torch.randint(4, R + 1, (1,), generator=g))
            while pos < length:
                seg = int(torch.randint(1, 9, (1,), generator=g))
                mask[i, pos:min(pos + seg, length)] = 1
                pos += seg + int(torch.randint(0, 7, (1,), generator=g))
        mask[5] = 0  # a row without policy tokens
        rewards = torch.zeros(B, R)
        score = torch.randint(0, 2, (B,), generator=g).float() + 0.25 * torch.rand(B, generator=g)
        last = torch.where(mask.any(-1), R - 1 - mask.flip(-1).argmax(-1), torch.zeros(B, dtype=torch.long))
        rewards[torch.arange(B), last] = score * mask.any(-1)
        probs = torch.softmax(torch.randn(B, R, 11, generator=g), -1)
        tok = torch.randint(0, 11, (B, R), generator=g)
        batch = {"token_level_rewards": rewards, "response_mask": mask,
                 "old_log_probs": probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1).log(),
                 "sum_pi_squared": probs.square().sum(-1)}
        if with_is:
            batch["rollout_is_weights"] = 0.5 + 1.5 * torch.rand(B, R, generator=g)
        uid = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 5 + ["solo"], dtype=object)
        return DataProto.from_dict(tensors=batch, non_tensors={"uid": uid})

    def run_verl(name, seed, with_is):
        data = compute_advantage(make_batch(seed, with_is), adv_estimator=name, num_repeat=4, config=AlgoConfig())
        return data.batch["advantages"].clone(), data.batch["returns"].clone()

    cases = [(n, s, w) for n in NAMES for s in (0, 1) for w in (False, True)]
    before = {c: run_verl(*c) for c in cases}
    plugin.install(); plugin.install()  # idempotent
    assert plugin.installed()
    assert reg["optimal_token_baseline"] is ours.optimal_token_baseline
    assert reg["tir_optimal_token_baseline"] is ours.tir_optimal_token_baseline
    report = {}
    for c in cases:
        adv, ret = run_verl(*c)
        b = make_batch(c[1], c[2]).batch
        direct = getattr(ours, c[0])(token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"],
                                     index=make_batch(c[1], c[2]).non_tensor_batch["uid"],
                                     old_log_probs=b["old_log_probs"], sum_pi_squared=b["sum_pi_squared"],
                                     rollout_is_weights=b.get("rollout_is_weights"))
        assert torch.equal(adv, direct[0]) and torch.equal(ret, direct[1]), c
        report[repr(c)] = [float((adv - before[c][0]).abs().max()), float((ret - before[c][1]).abs().max()),
                           float(adv.abs().max())]
        if c[2]:  # verl passes rollout_is_weights through to our function: they change the result
            no_is = compute_advantage(make_batch(c[1], False), adv_estimator=c[0], config=AlgoConfig())
            assert not torch.allclose(adv, no_is.batch["advantages"]), c
    plugin.uninstall()
    assert all(reg[n] is originals[n] for n in NAMES) and not plugin.installed()
    print("RESULT " + json.dumps(report))
''')


@pytest.mark.slow
def test_plugin_replaces_both_entries_and_compute_advantage_returns_ours():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT ") :])
    assert len(report) == 8
    for case, (adv_diff, ret_diff, adv_max) in report.items():
        assert adv_max > 0, case  # not a degenerate all-zero case
        assert adv_diff <= 1e-6 and ret_diff <= 1e-6, (case, adv_diff, ret_diff)  # ours equal verl's originals
