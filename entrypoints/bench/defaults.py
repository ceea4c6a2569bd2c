"""``fdx bench defaults``: which sampling defaults give right short chat
answers and sound long ones. Figures are reported, never asserted.

A fixed set of simple factual questions, each with the words that count as
the right answer, is asked through ``LLM.chat`` at every point of a grid of
temperature x top_p x repetition_penalty x presence_penalty x
frequency_penalty, with N seeds at each point (one for greedy: it does not
depend on the seed or top_p). With ``--open-max-tokens`` a few open
prompts (a haiku, a story, ...) are asked too, with a longer budget, for
the degeneracy of long answers. One engine runs the whole grid, every
request queued at once. For each point it reports:

- correct: the share of answers that hold a right word (case-insensitive,
  as a whole word: "4" is not found in "42" or "1.4"); first: the share
  whose first sentence holds it (an answer that opens with French-sounding
  words and names Paris later is correct, not first);
- repeat: the mean share of an answer's word 3-grams that repeat an earlier
  one in the same answer (0: no repetition), and loops: the share of
  answers in which some word 3-gram occurs three times or more;
- stop: the share of answers that ended by themselves within max_tokens;
- for the open prompts, repeat (as above), loops (a word 6-gram three
  times or more: a loop, not a phrase a story repeats) and stop.
"""
from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

# (question, words that count as right): facts a 135M instruct model can know
QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("What is 2+2?", ("4", "four")),
    ("How many days are there in a week?", ("7", "seven")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the chemical formula of water?", ("H2O", "H₂O")),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("At what temperature in degrees Celsius does water freeze?", ("0", "zero")),
    ("What language do people speak in Brazil?", ("Portuguese",)),
    ("What is the opposite of hot?", ("cold",)),
    ("How many legs does a spider have?", ("8", "eight")),
    ("What gas do plants take in from the air?", ("carbon dioxide", "CO2", "CO₂")),
    ("What is the largest ocean on Earth?", ("Pacific",)),
)

# open prompts, scored only for loops and for ending by themselves (the README's and a few more)
OPEN_PROMPTS: tuple[str, ...] = (
    "Write a haiku about the sea",
    "What is 2+2?",
    "Tell me about the city of Paris.",
    "Write a short story about a cat.",
    "Give me three tips for staying healthy.",
)

TEMPERATURES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)
TOP_PS = (0.9, 1.0)
REPETITION_PENALTIES = (1.0, 1.1)
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")


# -- scoring (plain text in, numbers out) -----------------------------------------------

def is_correct(text: str, answers: tuple[str, ...] | list[str]) -> bool:
    """Whether ``text`` holds one of ``answers`` as a whole word, ignoring
    case; a number must stand alone ("0" is not in "-18.0", "4" is in "4.")."""
    return any(re.search(rf"(?<![\w.,-]){re.escape(a)}(?!\w|[.,]\d)", text, re.IGNORECASE) for a in answers)


def first_sentence(text: str) -> str:
    """``text`` up to its first line break or sentence end (. ! ? before a
    space or the end)."""
    return re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0]


def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return list(zip(*(words[i:] for i in range(n))))


def repeated_ngram_share(text: str, n: int = 3) -> float:
    """The share of the word n-grams of ``text`` that repeat an earlier one
    (0 for none, or for a text shorter than n words)."""
    grams = _ngrams(text, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def loops(text: str, n: int = 3, times: int = 3) -> bool:
    """Whether some word n-gram occurs ``times`` times or more in ``text``."""
    return max(Counter(_ngrams(text, n)).values(), default=0) >= times


def grid(temperatures=TEMPERATURES, top_ps=TOP_PS, repetition_penalties=REPETITION_PENALTIES,
         presence_penalties=(0.0,), frequency_penalties=(0.0,)) -> list[dict]:
    """The grid's points, greedy (temperature 0) once per set of penalties:
    top_p does not change a greedy answer."""
    points = []
    for t, p, r, pp, fp in itertools.product(temperatures, top_ps, repetition_penalties, presence_penalties,
                                             frequency_penalties):
        point = {"temperature": float(t), "top_p": 1.0 if t == 0 else float(p), "repetition_penalty": float(r),
                 "presence_penalty": float(pp), "frequency_penalty": float(fp)}
        if point not in points:
            points.append(point)
    return points


def score(point: dict, answers: list[tuple[int, str, str]], questions=QUESTIONS) -> dict:
    """One grid point's figures from its answers: (question index, text, finish_reason) each."""
    n = len(answers)
    per_question = Counter(q for q, text, _ in answers if is_correct(text, questions[q][1]))
    first = sum(is_correct(first_sentence(text), questions[q][1]) for q, text, _ in answers)
    return {**point, "answers": n,
            "correct": sum(per_question.values()) / n if n else 0.0,
            "first": first / n if n else 0.0,
            "repeat": sum(repeated_ngram_share(text) for _, text, _ in answers) / n if n else 0.0,
            "loops": sum(loops(text) for _, text, _ in answers) / n if n else 0.0,
            "stop": sum(finish == "stop" for _, _, finish in answers) / n if n else 0.0,
            "correct_by_question": {questions[q][0]: per_question[q] / sum(1 for a in answers if a[0] == q)
                                    for q in sorted({a[0] for a in answers})}}


def score_open(answers: list[tuple[str, str]]) -> dict:
    """The open prompts' figures from their answers: (text, finish_reason) each."""
    n = len(answers)
    return {"answers": n, "repeat": sum(repeated_ngram_share(text) for text, _ in answers) / n if n else 0.0,
            "loops": sum(loops(text, 6) for text, _ in answers) / n if n else 0.0,
            "stop": sum(finish == "stop" for _, finish in answers) / n if n else 0.0,
            "mean_words": sum(len(re.findall(r"\w+", text)) for text, _ in answers) / n if n else 0.0}


# -- the run --------------------------------------------------------------------------------

def measure(llm, points: list[dict], seeds: int = 4, max_tokens: int = 48, questions=QUESTIONS,
            base_seed: int = 0, open_prompts=OPEN_PROMPTS, open_max_tokens: int = 0) -> list[dict]:
    """Ask every question at every point (``seeds`` seeded runs each, one
    for greedy) through ``llm.chat``, all at once, and with
    ``open_max_tokens`` each open prompt too; one scored dict a point,
    with its answers under "samples" ([question index, seed, text,
    finish_reason] each; open prompts as index -1 - their index)."""
    from fdx.core.sampling_params import SamplingParams
    asked = [(q, question, max_tokens) for q, (question, _) in enumerate(questions)]
    if open_max_tokens:
        asked += [(-1 - k, prompt, open_max_tokens) for k, prompt in enumerate(open_prompts)]
    convs, params, where = [], [], []
    for i, point in enumerate(points):
        for s in range(base_seed, base_seed + (1 if point["temperature"] == 0 else seeds)):
            for q, text, budget in asked:
                convs.append([{"role": "user", "content": text}])
                params.append(SamplingParams(**point, max_tokens=budget, seed=s))
                where.append((i, q, s))
    outs = llm.chat(convs, params)
    samples: list[list[list]] = [[] for _ in points]
    for (i, q, s), out in zip(where, outs):
        o = out.outputs[0]
        samples[i].append([q, s, o.text, o.finish_reason])
    result = []
    for point, got in zip(points, samples):
        r = score(point, [(q, text, finish) for q, _, text, finish in got if q >= 0], questions)
        if open_max_tokens:
            r["open"] = score_open([(text, finish) for q, _, text, finish in got if q < 0])
        result.append({**r, "samples": got})
    return result


def format_result(r: dict) -> str:
    opened = r.get("open_max_tokens")
    lines = [f"fdx bench defaults: {r['questions']} questions x {r['seeds']} seeds (greedy: 1), "
             f"max_tokens {r['max_tokens']}, {r['model']}"
             + (f"; {r['open_prompts']} open prompts, max_tokens {opened}" if opened else ""),
             f"  cpu {r['cpu']}; backend {r['backend']}; {r['time_s']:.0f} s",
             "  temperature  top_p  rep.pen  pres.pen  freq.pen  correct  first  repeat  loops  stop"
             + ("  open: repeat  loops  stop" if opened else "")]
    for p in r["points"]:
        t = "greedy" if p["temperature"] == 0 else f"{p['temperature']:g}"
        top_p = "-" if p["temperature"] == 0 else f"{p['top_p']:g}"
        line = (f"  {t:>11}  {top_p:>5}  {p['repetition_penalty']:>7g}  {p['presence_penalty']:>8g}  "
                f"{p['frequency_penalty']:>8g}  {100 * p['correct']:>6.0f}%  {100 * p['first']:>4.0f}%  "
                f"{p['repeat']:>6.3f}  {100 * p['loops']:>4.0f}%  {100 * p['stop']:>3.0f}%")
        if opened:
            line += (f"  {p['open']['repeat']:>12.3f}  {100 * p['open']['loops']:>4.0f}%  "
                     f"{100 * p['open']['stop']:>4.0f}%")
        lines.append(line)
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def run(args) -> dict:
    import time
    from fdx.entrypoints.engine_args import _make_llm
    from fdx.core.host import cpu_model
    points = grid(_floats(args.temperatures), _floats(args.top_ps), _floats(args.repetition_penalties),
                  _floats(args.presence_penalties), _floats(args.frequency_penalties))
    questions = QUESTIONS[:args.num_questions] if args.num_questions else QUESTIONS
    llm = _make_llm(args, progress=False)
    t0 = time.perf_counter()
    scored = measure(llm, points, args.seeds, args.max_tokens, questions, args.bench_seed,
                     open_max_tokens=args.open_max_tokens)
    return {"model": Path(llm.engine.model_path).name, "cpu": cpu_model(), "backend": llm.engine.backend.describe(),
            "questions": len(questions), "seeds": args.seeds, "max_tokens": args.max_tokens,
            "open_prompts": len(OPEN_PROMPTS) if args.open_max_tokens else 0, "open_max_tokens": args.open_max_tokens,
            "time_s": time.perf_counter() - t0, "points": scored}


def cmd(args) -> int:
    import json
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def add_parser(bench_subparsers) -> None:
    """Add ``fdx bench defaults`` to the ``fdx bench`` sub-commands."""
    from fdx.entrypoints.engine_args import _add_engine_args
    p = bench_subparsers.add_parser("defaults", help="right answers and repetition over a grid of sampling "
                                                     "settings: how a model's chat defaults are chosen")
    p.add_argument("--temperatures", default=",".join(f"{t:g}" for t in TEMPERATURES),
                   help="comma-separated; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-ps", default=",".join(f"{t:g}" for t in TOP_PS), help="comma-separated (default: %(default)s)")
    p.add_argument("--repetition-penalties", default=",".join(f"{t:g}" for t in REPETITION_PENALTIES),
                   help="comma-separated (default: %(default)s)")
    p.add_argument("--presence-penalties", default="0", help="comma-separated (default: %(default)s)")
    p.add_argument("--frequency-penalties", default="0", help="comma-separated (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=4, help="seeded runs of each question at each sampled point "
                                                        "(default: 4; greedy runs once)")
    p.add_argument("--num-questions", type=int, default=None,
                   help=f"ask only the first N questions (default: all {len(QUESTIONS)})")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens an answer may have (default: 48)")
    p.add_argument("--open-max-tokens", type=int, default=0,
                   help=f"also ask {len(OPEN_PROMPTS)} open prompts with this budget, for loops in long "
                        "answers (default: 0, not asked)")
    p.add_argument("--bench-seed", type=int, default=0, help="the first sampling seed (default: 0)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON (default: a table)")
    _add_engine_args(p)
    p.set_defaults(func=cmd)
