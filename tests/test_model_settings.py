"""model.chat_template and model.generation_config (vLLM's --chat-template
and --generation-config) reach the engine: the template renders as jinja2
renders it, from a file or inline; the sampling defaults come from the
model, from nowhere (vllm), or from another folder."""
from __future__ import annotations

import json

import jinja2
import pytest

from fdx import LLM
from fdx.core.config import ConfigError

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
BASE = dict(max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)


@pytest.mark.parametrize("as_file", [True, False])
def test_chat_template_from_a_file_or_inline(tiny_checkpoints, tmp_path, as_file):
    from fdx import SamplingParams
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    source = TEMPLATE
    if as_file:
        f = tmp_path / "chat.jinja"
        f.write_text(TEMPLATE)
        source = str(f)
    llm = LLM(str(path), chat_template=source, **BASE)
    want = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1))[0]
    assert out.prompt == want
    assert out.prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)


def test_a_chat_template_that_is_neither_file_nor_template_names_the_key(tiny_checkpoints):
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="model.chat_template"):
        LLM(str(path), chat_template="./no-such-template.jinja", **BASE)


def test_generation_config_auto_vllm_or_a_folder(tiny_checkpoints, tmp_path):
    src, _ = tiny_checkpoints["LlamaForCausalLM"]
    model = tmp_path / "model"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 7}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    auto = LLM(str(model), **BASE).get_default_sampling_params()
    assert (auto.temperature, auto.top_k) == (0.6, 7)
    none = LLM(str(model), generation_config="vllm", **BASE).get_default_sampling_params()
    assert (none.temperature, none.top_k) == (1.0, -1)                    # SamplingParams' own
    folder = LLM(str(model), generation_config=str(other), **BASE).get_default_sampling_params()
    assert (folder.temperature, folder.top_k) == (0.25, -1)
    with pytest.raises((ValueError, ConfigError), match="model.generation_config"):
        LLM(str(model), generation_config=str(tmp_path / "nowhere"), **BASE)
