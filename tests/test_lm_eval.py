"""lm-eval's `local-completions` against a real `fdx serve` (issue 38): a
small multiple-choice task the repo ships (tests/data/lm_eval, questions
written for fdx) scored by loglikelihood, and loglikelihood_rolling over
short texts. Each loglikelihood lm-eval reports equals the sum of the same
tokens' logprobs from `LLM.generate(..., prompt_logprobs=...)` in-process on
the same float32 weights (a tiny random Llama), and transformers' on those
weights (whose tokenizer folder the test reads: the same tokens). lm-eval
tokenizes through the server (its remote tokenizer: /tokenizer_info and
/tokenize), so nothing is downloaded and tiktoken is not used."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from serve_utils import API_KEY, serving

from fdx import LLM, SamplingParams

pytestmark = pytest.mark.slow

TASKS = pathlib.Path(__file__).parent / "data" / "lm_eval"
MAX_LENGTH = 24                       # lm-eval's window: the rolling texts span several


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path, model = tiny_checkpoints["LlamaForCausalLM"]
    return path, model


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny):
    with serving(tmp_path_factory.mktemp("lm_eval"), model={"model": str(tiny[0]), "quantization": "none"},
                 server={"served_model_name": "tiny"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def evaluated(server, tiny, tmp_path_factory):
    """lm-eval's samples for both tasks, run as its CLI would."""
    import os

    import lm_eval
    from lm_eval.tasks import TaskManager
    cwd = os.getcwd()
    saved = {k: os.environ.get(k) for k in ("OPENAI_API_KEY", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(OPENAI_API_KEY=API_KEY, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    os.chdir(TASKS)                    # the tasks' data_files are relative
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": "tiny", "base_url": server.base_url + "/v1/completions",
                        "tokenizer_backend": "remote", "auth_token": API_KEY, "num_concurrent": 1,
                        "max_retries": 1, "max_length": MAX_LENGTH, "batch_size": 3},
            tasks=["fdx_mc", "fdx_rolling"], task_manager=TaskManager(include_path=str(TASKS)),
            log_samples=True, cache_requests=False)
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out["samples"]


@pytest.fixture(scope="module")
def reference(tiny):
    """token ids -> each token's logprob after the ones before it (None for the
    first), from fdx in-process and from transformers, on the same weights."""
    import torch
    path, model = tiny
    with LLM(str(path), quantization="none", max_model_len=512, num_kv_blocks=64, block_size=16,
             progress=False) as llm:
        def run(ids: list[int]) -> tuple[list, np.ndarray]:
            (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1))
            fdx = [None] + [out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].double()
            hf = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
            return fdx, hf
        yield run


def test_lm_eval_finds_the_remote_tokenizer(server):
    """What lm-eval's tokenizer_backend=auto checks before it would fall back to a hub download."""
    from lm_eval.utils import check_remote_tokenizer_support
    assert check_remote_tokenizer_support(server.base_url + "/v1/completions", auth_token=API_KEY)


def test_multiple_choice_loglikelihoods_equal_the_engine(evaluated, reference, tiny):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny[0]))
    docs = [json.loads(line) for line in (TASKS / "fdx_mc.jsonl").read_text().splitlines()]
    samples = sorted(evaluated["fdx_mc"], key=lambda s: s["doc_id"])
    assert [s["doc"]["question"] for s in samples] == [d["question"] for d in docs]
    for s in samples:
        assert len(s["resps"]) == len(s["doc"]["choices"])
        for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"]):
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            assert whole[:len(ctx)] == ctx
            fdx, hf = reference(whole)
            want = sum(fdx[len(ctx):])
            assert ll == pytest.approx(want, abs=1e-5), (context, continuation)
            assert ll == pytest.approx(float(hf[len(ctx) - 1:].sum()), abs=1e-3)
        assert s["acc"] == float(np.argmax([r[0][0] for r in s["resps"]]) == s["doc"]["answer"])


def test_rolling_loglikelihoods_equal_the_engine(evaluated, reference, tiny):
    """lm-eval's windows of MAX_LENGTH tokens (its own split): each window's
    predicted tokens scored after its context, summed over the text."""
    import transformers
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny[0]))
    samples = sorted(evaluated["fdx_rolling"], key=lambda s: s["doc_id"])
    texts = [json.loads(line)["text"] for line in (TASKS / "fdx_rolling.jsonl").read_text().splitlines()]
    assert [s["doc"]["text"] for s in samples] == texts
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    for s, text in zip(samples, texts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # lm-eval keeps one of max_length's tokens for generation, and one more for a window's context
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, prefix, MAX_LENGTH - 2, 1)]
        assert len(ids) < MAX_LENGTH or len(windows) > 1
        want = 0.0
        for ctx, pred in windows:
            fdx, _ = reference(ctx + pred)
            want += sum(fdx[len(ctx):])
        (got,) = s["resps"][0]
        assert got == pytest.approx(want, abs=1e-4), text
