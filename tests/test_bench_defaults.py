"""``fdx bench defaults``: its scoring (no model) and a run on a tiny grid."""
from __future__ import annotations

import json

import pytest

from fdx.entrypoints.bench import defaults as bd


def test_a_right_answer_is_a_whole_word_or_a_number_standing_alone():
    yes = [("The capital of France is Paris.", ("Paris",)), ("paris!", ("Paris",)), ("2+2 is 4.", ("4", "four")),
           ("It has eight legs", ("8", "eight")), ("water freezes at 0°C", ("0", "zero")),
           ("They take in carbon dioxide (CO2).", ("carbon dioxide", "CO2")), ("H₂O", ("H2O", "H₂O"))]
    no = [("Parisian food", ("Paris",)), ("42", ("4",)), ("-18.0°C", ("0",)), ("1.4 or 4,5", ("4",)),
          ("The capital is Lyon", ("Paris",)), ("", ("Paris",))]
    assert [bd.is_correct(t, a) for t, a in yes] == [True] * len(yes)
    assert [bd.is_correct(t, a) for t, a in no] == [False] * len(no)


def test_the_first_sentence_ends_at_a_sentence_end_or_a_line_break():
    assert bd.first_sentence("Allez! The capital of France is Paris.") == "Allez!"
    assert bd.first_sentence("  It is 2.5 km. Then more") == "It is 2.5 km."
    assert bd.first_sentence("Paris\n\nThe capital") == "Paris"
    assert bd.first_sentence("The capital of France is Paris") == "The capital of France is Paris"


def _brute_repeats(text: str, n: int) -> tuple[float, int]:
    """(share of n-grams seen before, the most times one n-gram occurs), by hand."""
    import re
    words = re.findall(r"\w+", text.lower())
    grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    seen, repeats = [], 0
    for g in grams:
        repeats += g in seen
        seen.append(g)
    return (repeats / len(grams) if grams else 0.0), max((grams.count(g) for g in grams), default=0)


@pytest.mark.parametrize("text", [
    "", "Paris", "The capital of France is Paris.",
    "a b c a b c a b c", "Açúmar, açúmar, açúmar, açúmar, açúmar.",
    "The sky is blue. The sky is blue. The sea is blue.",
])
def test_repetition_figures_match_a_brute_force_count(text):
    share, most = _brute_repeats(text, 3)
    assert bd.repeated_ngram_share(text) == pytest.approx(share)
    assert bd.loops(text) == (most >= 3)


def test_greedy_is_one_point_per_set_of_penalties():
    points = bd.grid((0, 0.2), (0.9, 1.0), (1.0, 1.1), (0.0,), (0.0, 0.5))
    pen = [{"repetition_penalty": r, "presence_penalty": 0.0, "frequency_penalty": f}
           for r in (1.0, 1.1) for f in (0.0, 0.5)]
    assert points == ([{"temperature": 0.0, "top_p": 1.0, **p} for p in pen]
                      + [{"temperature": 0.2, "top_p": top_p, **p} for top_p in (0.9, 1.0) for p in pen])


def test_a_points_figures_count_its_answers():
    questions = (("Capital of France?", ("Paris",)), ("2+2?", ("4",)))
    point = {"temperature": 0.5, "top_p": 0.9, "repetition_penalty": 1.0, "presence_penalty": 0.0,
             "frequency_penalty": 0.2}
    answers = [(0, "Paris.", "stop"), (0, "Lyon, Lyon, Lyon, Lyon, Lyon", "length"),
               (1, "Bonjour! It is 4.", "stop"), (1, "It is 4.", "stop")]
    r = bd.score(point, answers, questions)
    assert {k: r[k] for k in point} == point and r["answers"] == 4
    assert r["correct"] == 3 / 4 and r["first"] == 2 / 4 and r["stop"] == 3 / 4 and r["loops"] == 1 / 4
    assert r["repeat"] == pytest.approx((0 + 2 / 3 + 0 + 0) / 4)     # 3 Lyon-trigrams, 2 seen before
    assert r["correct_by_question"] == {"Capital of France?": 0.5, "2+2?": 1.0}
    table = bd.format_result({"questions": 2, "seeds": 2, "max_tokens": 8, "model": "m.gguf", "cpu": "a CPU",
                              "backend": "cpu", "time_s": 1.0, "points": [r]})
    assert "m.gguf" in table and "a CPU" in table and "open" not in table
    assert table.splitlines()[-1].split() == ["0.5", "0.9", "1", "0", "0.2", "75%", "50%", "0.167", "25%", "75%"]
    opened = bd.score_open([("a b c d e f " * 3, "length"), ("a b c d e f " * 2, "stop")])
    assert opened == {"answers": 2, "repeat": pytest.approx((10 / 16 + 4 / 10) / 2), "loops": 0.5, "stop": 0.5,
                      "mean_words": 15.0}
    table = bd.format_result({"questions": 2, "seeds": 2, "max_tokens": 8, "model": "m.gguf", "cpu": "a CPU",
                              "backend": "cpu", "time_s": 1.0, "open_prompts": 5, "open_max_tokens": 64,
                              "points": [{**r, "open": opened}]})
    assert "5 open prompts, max_tokens 64" in table
    assert table.splitlines()[-1].split()[-3:] == [f"{opened['repeat']:.3f}", "50%", "50%"]


def test_bad_grid_values_are_an_error_naming_them():
    with pytest.raises(ValueError, match="'0.1,x'"):
        bd._floats("0.1,x")


def test_measure_asks_each_point_with_its_own_settings(smollm_llm):
    """Two questions, greedy and one sampled point with 2 seeds; the
    reference is llm.chat with each setting, scored by hand."""
    from fdx import SamplingParams
    questions = bd.QUESTIONS[:2]
    points = bd.grid((0, 0.7), (0.9,), (1.0,), (0.0,), (0.5,))
    got = bd.measure(smollm_llm, points, seeds=2, max_tokens=8, questions=questions, base_seed=5,
                     open_prompts=("Write a haiku about the sea",), open_max_tokens=12)
    assert [g["answers"] for g in got] == [2, 4] and [g["open"]["answers"] for g in got] == [1, 2]
    for point, g in zip(points, got):
        seeds = [None] if point["temperature"] == 0 else [5, 6]
        texts = [(q, smollm_llm.chat([{"role": "user", "content": question}],
                                     SamplingParams(**point, max_tokens=8, seed=s))[0].outputs[0])
                 for s in seeds for q, (question, _) in enumerate(questions)]
        right = sum(bd.is_correct(o.text, questions[q][1]) for q, o in texts)
        assert g["correct"] == right / len(texts)
        assert g["stop"] == sum(o.finish_reason == "stop" for _, o in texts) / len(texts)
        assert [text for q, _, text, _ in g["samples"] if q >= 0] == [o.text for _, o in texts]
        haiku = [smollm_llm.chat([{"role": "user", "content": "Write a haiku about the sea"}],
                                 SamplingParams(**point, max_tokens=12, seed=s))[0].outputs[0] for s in seeds]
        assert [text for q, _, text, _ in g["samples"] if q < 0] == [o.text for o in haiku]
        assert g["open"]["stop"] == sum(o.finish_reason == "stop" for o in haiku) / len(haiku)


@pytest.mark.slow
def test_fdx_bench_defaults_runs_a_tiny_grid(capsys):
    from fdx.entrypoints.cli import main
    assert main(["bench", "defaults", "--temperatures", "0", "--top-ps", "1", "--repetition-penalties", "1",
                 "--presence-penalties", "0", "--num-questions", "2", "--max-tokens", "8",
                 "--max-model-len", "256", "--num-kv-blocks", "32", "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and r["questions"] == 2 and r["cpu"]
    (point,) = r["points"]
    assert point["temperature"] == 0 and point["answers"] == 2
    assert list(point["correct_by_question"]) == [q for q, _ in bd.QUESTIONS[:2]]
