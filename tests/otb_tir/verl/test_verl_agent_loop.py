"""The OTB agent loop under verl 0.9.1's own AgentLoopWorker, on CPU, without Ray or GPUs.

verl's ``AgentLoopWorker`` is built in-process from the config ``compose_verl_config`` writes (it
reads our agent-loop YAML, instantiates ``OTBToolAgentLoop`` per sample with hydra, pads and
collates). The server manager is a stand-in with the same ``generate(request_id, *, prompt_ids,
sampling_params, ...)`` → ``TokenOutput`` signature as verl's ``LLMServerClient``, backed by a
real ``HFEngine`` on the tiny Qwen3 policy; every other episode is scripted (a calculator call,
then the answer it returned) so tool tokens and a correct reward occur for sure, with log-probs
teacher-forced by the same model. The python and calculator tools are the real ones.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import numpy as np
import pytest
import torch

from tests.support.optional import need

need("verl")

from tests.support.verl_agent_loop import HFServerManager, _gen_batch, run_agent_loop  # noqa: E402


def _small_verl_run(model_dir, out) -> list[str]:
    """The overrides of a small ``trainer=verl`` run (2 prompts × 2 samples, 3 turns) of these tests."""
    return [
        f"model.path={model_dir}",
        "trainer=verl",
        "rollout.name=vllm",
        f"trainer.output_dir={out}",
        "data.train_size=6",
        "data.val_size=2",
        "rollout.n=2",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "rollout.response_length=160",
        "rollout.max_tokens_per_turn=40",
        "multi_turn.max_assistant_turns=3",
        "trainer.n_gpus_per_node=1",
    ]


@pytest.fixture(scope="module")
def verl_setup(tiny_model_dir, tmp_path_factory):
    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config, validate_verl_config

    out = tmp_path_factory.mktemp("verl_run")
    cfg = load_config(
        None,
        [
            *_small_verl_run(tiny_model_dir, out),
            "multi_turn.tool_timeout=120",
        ],
    )  # generous: a loaded CI machine starts sympy slowly
    vcfg = compose_verl_config(cfg)
    validate_verl_config(vcfg)
    return cfg, vcfg


@pytest.mark.verl
def test_agent_loop_runs_real_episodes_under_verls_worker(verl_setup, tiny_model_dir, tiny_tokenizer):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry

    from agent_env.math_task.data import load_parquet
    from otb_tir.verl.agent_loop import close_cached_tools

    cfg, vcfg = verl_setup
    n_prompts, n = 2, 2
    items = load_parquet(vcfg.data.train_files[0])
    questions = {it["extra_info"]["question"]: it["extra_info"]["expression"] for it in items}
    manager = HFServerManager(tiny_model_dir, tiny_tokenizer, questions)

    async def go():
        worker = AgentLoopWorker(vcfg, llm_client=manager)
        batch, rows = _gen_batch(vcfg, worker.tokenizer, n_prompts, n)
        assert list(batch.non_tensor_batch["agent_name"]) == ["tool_agent"] * (n_prompts * n)
        try:
            out = await worker.generate_sequences(batch)
        finally:
            await close_cached_tools()
            if manager.engine is not None:
                await manager.engine.close()
        return worker, out

    worker, out = asyncio.run(go())
    # verl's worker resolved both names of our YAML to our class
    for name in ("otb_tir_agent", "tool_agent"):
        assert _agent_loop_registry[name]["_target_"] == "otb_tir.verl.agent_loop.OTBToolAgentLoop"

    P, R = vcfg.actor_rollout_ref.rollout.prompt_length, vcfg.actor_rollout_ref.rollout.response_length
    b = out.batch
    B = n_prompts * n
    assert b["prompts"].shape == (B, P) and b["responses"].shape == (B, R)
    assert b["input_ids"].shape == (B, P + R) and b["rollout_log_probs"].shape == (B, R)
    mask, resp, lp = b["response_mask"], b["responses"], b["rollout_log_probs"]
    resp_len = b["attention_mask"][:, P:].sum(-1)

    # 1. mask = 1 tokens are exactly what the server sampled, in order, with its log-probs
    sampled = Counter()
    sampled_lp = {}
    for outs in manager.outputs.values():
        key = tuple(t for o in outs for t in o.token_ids)
        sampled[key] += 1
        sampled_lp[key] = [x for o in outs for x in o.log_probs]
    got = Counter()
    for i in range(B):
        m = mask[i].bool()
        key = tuple(resp[i][m].tolist())
        got[key] += 1
        assert lp[i][m].tolist() == pytest.approx(sampled_lp[key], abs=1e-6)
        assert torch.all(lp[i][~m] == 0)
        assert torch.all(mask[i, resp_len[i] :] == 0)
    assert got == sampled
    assert len(manager.order) == B

    # 2. lengths: within verl's prompt/response budgets; mask only on real tokens
    assert int(resp_len.max()) <= R and int(b["attention_mask"][:, :P].sum(-1).max()) <= P

    # 3. tool tokens: scripted episodes called the calculator; its result is in mask-0 tokens and the
    #    answer built from it earns reward 1 (rm_scores on the last response token)
    scripted_rows = 0
    rm = b["rm_scores"]
    for i in range(B):
        m = mask[i].bool()
        valid = torch.arange(R) < resp_len[i]
        inserted = resp[i][valid & ~m]
        assert torch.count_nonzero(rm[i]) <= 1 and (rm[i].sum() == 0 or rm[i, resp_len[i] - 1] != 0)
        assert mask[i, resp_len[i] - 1] == 1  # the reward sits on a sampled token
        if inserted.numel():
            text = tiny_tokenizer.decode(inserted.tolist())
            assert "<tool_response>" in text
            scripted_rows += 1
            assert float(rm[i, resp_len[i] - 1]) == 1.0, tiny_tokenizer.decode(resp[i][valid].tolist())
            assert out.non_tensor_batch["acc"][i] == 1.0
            assert out.non_tensor_batch["tool_calls"][i] == 1.0
            assert out.non_tensor_batch["__num_turns__"][i] == 4  # user, assistant, tool, assistant
    assert scripted_rows == B // 2

    # 4. the layout verl trains on: recomputing log-probs with the same model over verl's padded
    #    input_ids/attention_mask/position_ids reproduces the rollout log-probs at every mask = 1 token
    with torch.no_grad():
        logits = (
            manager.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
            .logits[:, P - 1 : -1]
            .float()
        )
    recomputed = torch.log_softmax(logits, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    m = mask.bool()
    assert torch.allclose(recomputed[m], lp[m], atol=2e-4), (recomputed[m] - lp[m]).abs().max()

    # 5. the rollout feeds verl's compute_advantage with our TIR-OTB installed (as the trainer does)
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from otb_tir.advantage import tir_optimal_token_baseline
    from otb_tir.token_stats import sum_pi_squared_from_logits
    from otb_tir.verl import plugin

    b["old_log_probs"] = recomputed * mask
    b["sum_pi_squared"] = sum_pi_squared_from_logits(logits) * mask
    b["token_level_rewards"] = b["rm_scores"]
    plugin.install()
    try:
        adv = compute_advantage(
            out, adv_estimator="tir_optimal_token_baseline", num_repeat=n, config=AlgoConfig()
        ).batch["advantages"]
    finally:
        plugin.uninstall()
    direct, _ = tir_optimal_token_baseline(
        b["rm_scores"],
        mask,
        out.non_tensor_batch["uid"],
        old_log_probs=b["old_log_probs"],
        sum_pi_squared=b["sum_pi_squared"],
    )
    assert torch.equal(adv, direct) and torch.all(adv[~m] == 0) and adv.abs().sum() > 0


def test_server_manager_engine_contract():
    """Finish reasons, abort, and a server that drops log-probs."""
    from verl.workers.rollout.replica import TokenOutput

    from agent_env.engines.base import EngineError, SamplingParams
    from otb_tir.verl.agent_loop import ServerManagerEngine

    class Fake:
        def __init__(self, out):
            self.out, self.seen = out, None

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            self.seen = (request_id, list(prompt_ids), dict(sampling_params))
            return self.out

    params = SamplingParams(max_tokens=3, stop_token_ids=[9], temperature=0.5)
    base = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    cases = [
        (TokenOutput(token_ids=[1, 9], log_probs=[-1.0, -2.0], stop_reason="completed"), "stop"),
        (TokenOutput(token_ids=[1, 2, 3], log_probs=[-1.0] * 3, stop_reason="completed"), "length"),
        (TokenOutput(token_ids=[1, 2, 9], log_probs=[-1.0] * 3, stop_reason="completed"), "stop"),
        (TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted"), "abort"),
    ]
    for token_out, finish in cases:
        fake = Fake(token_out)
        eng = ServerManagerEngine(fake, base, request_id="r1")
        res = asyncio.run(eng.generate([5, 6], params))
        assert res.finish_reason == finish
        rid, prompt, sp = fake.seen
        # verl's sampling settings win (greedy validation), the episode adds its cap and stop ids
        assert rid == "r1" and prompt == [5, 6] and sp["temperature"] == 0.0 and sp["max_tokens"] == 3
        assert sp["stop_token_ids"] == [9] and sp["logprobs"] is True
    with pytest.raises(EngineError, match="log-probs"):
        asyncio.run(ServerManagerEngine(Fake(TokenOutput(token_ids=[1], log_probs=None)), base).generate([5], params))


def test_the_episode_reports_the_weight_versions_its_turns_used():
    """verl's V1 trainer bounds and reports staleness from each trajectory's min/max weight version
    (TransferQueue tags from the agent loop's extra_fields): over all turns of a multi-turn episode,
    whether the server reports one version per turn (LLMServerClient: ``global_steps``) or a range
    (FullyAsyncLLMServerClient after a resumed partial rollout: ``min_/max_global_steps``)."""
    from verl.workers.rollout.replica import TokenOutput

    from agent_env.engines.base import SamplingParams
    from otb_tir.verl.agent_loop import ServerManagerEngine

    turns = iter(
        [
            TokenOutput(token_ids=[1], log_probs=[-1.0], extra_fields={"global_steps": 3}),
            TokenOutput(
                token_ids=[2],
                log_probs=[-1.0],
                extra_fields={"global_steps": 5, "min_global_steps": 4, "max_global_steps": 5},
            ),
            TokenOutput(token_ids=[3], log_probs=[-1.0], extra_fields={"global_steps": 5}),
        ]
    )

    class Server:
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            return next(turns)

    eng = ServerManagerEngine(Server(), {"temperature": 1.0})
    assert eng.version_fields() == {}  # nothing generated yet: no version to report
    for _ in range(3):
        asyncio.run(eng.generate([5], SamplingParams(max_tokens=4)))
    assert eng.version_fields() == {"min_global_steps": 3, "max_global_steps": 5}


@pytest.mark.verl
def test_prompt_longer_than_verls_budget_is_skipped_not_truncated(verl_setup, tiny_model_dir, tiny_tokenizer):
    """verl would left-truncate a prompt the policy never saw; we return an empty, reward-0 row."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from otb_tir.verl.agent_loop import close_cached_tools
    from otb_tir.verl.compose import compose_verl_config

    cfg, _ = verl_setup
    vcfg = compose_verl_config(cfg, overrides=["data.max_prompt_length=32", "data.filter_overlong_prompts=false"])
    manager = HFServerManager(tiny_model_dir, tiny_tokenizer, {})

    async def go():
        worker = AgentLoopWorker(vcfg, llm_client=manager)
        batch, _ = _gen_batch(vcfg, worker.tokenizer, 1, 2)
        try:
            return await worker.generate_sequences(batch)
        finally:
            await close_cached_tools()

    out = asyncio.run(go())
    assert manager.outputs == {}  # nothing was generated
    b = out.batch
    assert b["prompts"].shape == (2, 32) and int(b["response_mask"].sum()) == 0
    assert int(b["attention_mask"][:, 32:].sum()) == 0 and float(b["rm_scores"].abs().sum()) == 0.0
    assert list(out.non_tensor_batch["otb_skipped"]) == ["prompt_too_long"] * 2


STALL_TOOL = '''
import asyncio, json, os
from tools import tool


@tool
async def stall(expression: str) -> str:
    """A calculator that never answers."""
    with open(os.environ["STALL_LOG"], "a") as f:
        f.write(json.dumps({"expression": expression}) + "\\n")
    await asyncio.Event().wait()
'''

FLAKY_REWARD = '''
import fcntl, json, os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on one call, NaN on the next, and so on: a broken user reward. (Episodes score
    concurrently: the count is read and written under a lock, or two calls can both see 0.)"""
    with open(os.environ["REWARD_LOG"], "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = sum(1 for _ in f)
        f.write(json.dumps({"call": n}) + "\\n")
    if n % 2 == 0:
        raise ValueError("the checker broke")
    return float("nan")
'''


@pytest.mark.verl
def test_a_hanging_tool_and_a_failing_reward_inside_verls_agent_loop_are_bounded_and_counted(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    """verl's AgentLoopWorker running our agent loop with a user's tool that never answers and a user
    reward that raises or returns NaN: every episode comes back (the tool call times out into an
    error observation, the reward into reward 0 with its error kind), counted in the batch's reward
    extra info as on the local path; the plugin's own logs show each was really called."""
    from agent_env.math_task.data import load_parquet
    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config

    user = tmp_path / "user"
    user.mkdir()
    (user / "stall_tool.py").write_text(STALL_TOOL)
    (user / "flaky_reward.py").write_text(FLAKY_REWARD)
    monkeypatch.setenv("STALL_LOG", str(user / "stall.jsonl"))
    monkeypatch.setenv("REWARD_LOG", str(user / "reward.jsonl"))
    monkeypatch.chdir(user)  # relative plugin paths, as the user typed them
    cfg = load_config(
        None,
        [
            *_small_verl_run(tiny_model_dir, tmp_path / "run"),
            "multi_turn.tools=[stall_tool.py:stall]",
            "multi_turn.tool_timeout=2",
            "reward.custom_reward_function.path=flaky_reward.py",
            "reward.timeout_seconds=5",
        ],
    )
    vcfg = compose_verl_config(cfg)
    monkeypatch.setenv("OTB_TIR_REWARD", vcfg.ray_kwargs.ray_init.runtime_env.env_vars["OTB_TIR_REWARD"])
    items = load_parquet(vcfg.data.train_files[0])
    questions = {it["extra_info"]["question"]: it["extra_info"]["expression"] for it in items}
    manager = HFServerManager(tiny_model_dir, tiny_tokenizer, questions)
    manager._script_tool = "stall"  # the scripted rows call the user's stalling tool

    out = run_agent_loop(vcfg, manager)
    nt = out.non_tensor_batch
    B = 4
    stalled = [json.loads(x) for x in (user / "stall.jsonl").read_text().splitlines()]
    assert len(stalled) == B // 2  # the scripted half called the tool, each call timed out
    assert float(np.sum(np.asarray(nt["tool_kind_timeout"], float))) == B // 2
    assert float(np.sum(np.asarray(nt["tool_calls"], float))) >= B // 2
    calls = (user / "reward.jsonl").read_text().splitlines()
    assert len(calls) == B  # the user's reward was called once per episode
    errors = {k: float(np.sum(np.asarray(nt[f"reward_error_{k}"], float))) for k in ("exception", "nan")}
    assert errors == {"exception": B / 2, "nan": B / 2}
    rm = out.batch["rm_scores"]
    assert torch.isfinite(rm).all() and float(rm.abs().sum()) == 0.0  # reward 0, never NaN, for every failure


MCP_CALC = '''
import json, os, sys
from mcp.server.mcpserver import MCPServer

app = MCPServer("calc")


@app.tool()
def mcp_calc(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    with open(os.environ["CALL_LOG"], "a") as f:
        f.write(json.dumps({"expression": expression, "pid": os.getpid()}) + "\\n")
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        raise ValueError("not arithmetic")
    value = eval(expression, {"__builtins__": {}})
    return str(int(value)) if float(value).is_integer() else str(value)


if __name__ == "__main__":
    app.run()
'''


@pytest.mark.verl
def test_an_mcp_servers_tool_is_called_from_verls_agent_loop(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """``multi_turn.mcp_servers`` reaches verl's workers: compose writes the server file into our
    agent-loop YAML, verl's own AgentLoopWorker builds our loop, whose tool set starts the user's MCP
    server (a stdio server in a folder outside the project, under bubblewrap); the scripted rows call
    its tool, the server's own log records each call, and its answers come back into the rows."""
    need("mcp")
    from omegaconf import OmegaConf

    from agent_env.math_task.data import load_parquet
    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config

    user = tmp_path / "user"
    user.mkdir()
    (user / "calc_server.py").write_text(MCP_CALC)
    log = user / "calls.jsonl"
    log.touch()
    servers = user / "servers.json"
    servers.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "calc": {
                        "command": __import__("sys").executable,
                        "args": [str(user / "calc_server.py")],
                        "env": {"CALL_LOG": str(log)},
                        "writable_paths": [str(log)],
                    }
                }
            }
        )
    )
    monkeypatch.chdir(user)
    cfg = load_config(
        None,
        [*_small_verl_run(tiny_model_dir, tmp_path / "run"), "multi_turn.mcp_servers=servers.json"],
    )
    vcfg = compose_verl_config(cfg)
    entry = OmegaConf.load(vcfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)[0]
    assert entry["otb_mcp_servers"] == str(servers) and entry["otb_tools"] is None  # all the servers' tools
    items = load_parquet(vcfg.data.train_files[0])
    questions = {it["extra_info"]["question"]: it["extra_info"]["expression"] for it in items}
    manager = HFServerManager(tiny_model_dir, tiny_tokenizer, questions)
    manager._script_tool = "mcp_calc"

    out = run_agent_loop(vcfg, manager)
    B = 4
    served = [json.loads(line) for line in log.read_text().splitlines()]
    assert {c["expression"] for c in served} <= set(questions.values())
    assert len(served) == B // 2  # the scripted half called the server's tool, once each
    nt = out.non_tensor_batch
    assert float(np.sum(np.asarray(nt["tool_calls"], float))) >= B // 2
    # every call answered (no error kind counted), and its result is what the server computed
    kinds = {k: float(np.sum(np.asarray(v, float))) for k, v in nt.items() if k.startswith("tool_kind_")}
    assert not any(kinds.values()), kinds
    texts = [tiny_tokenizer.decode(r.tolist()) for r in out.batch["responses"]]
    for c in served:
        value = eval(c["expression"], {"__builtins__": {}})  # the server's own rule, as an oracle
        shown = str(int(value)) if float(value).is_integer() else str(value)
        assert any(f"<tool_response>\n{shown}\n</tool_response>" in t for t in texts), (shown, texts)
