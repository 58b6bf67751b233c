"""SGLang's frontend language, run unchanged against a radixserve server.

The programs of SGLang's frontend documentation (gen, select, fork, a
regex-constrained gen, multi-turn chat, batches with run_batch), with
``sgl.set_default_backend(sgl.RuntimeEndpoint(url))`` pointed at ``radixserve launch
--http-port``. SGLang is not a dependency of radixserve: this script runs in a venv
of its own, which ``bench/sglang_frontend.sh`` makes. Prints one line per program:
ok or the error, and what it produced.

    .venv-sglang/bin/python bench/sglang_frontend.py http://127.0.0.1:PORT
"""

from __future__ import annotations

import sys
import traceback

import sglang as sgl


@sgl.function
def multi_turn(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32, temperature=0))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32, temperature=0))


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "


@sgl.function
def tip_suggestion(s):
    s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=24, stop="\n\n", temperature=0)
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=24, temperature=0)


@sgl.function
def regular_expression_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen(
        "answer",
        temperature=0,
        regex=r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    )


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n", max_tokens=16, temperature=0)


def main() -> None:
    url = sys.argv[1]
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    runs = [
        ("multi-turn chat (gen)", lambda: multi_turn.run(
            question_1="What is the capital of France?", question_2="And of Italy?"),
         lambda st: (st["answer_1"], st["answer_2"])),
        ("select (choices)", lambda: tool_use.run(question="What is 25 * 17?"),
         lambda st: st["tool"]),
        ("fork", lambda: tip_suggestion.run(), lambda st: st["summary"]),
        ("regex-constrained gen", lambda: regular_expression_gen.run(), lambda st: st["answer"]),
        ("few-shot, run_batch", lambda: few_shot_qa.run_batch(
            [{"question": "What is the capital of Spain?"},
             {"question": "What is the capital of Japan?"}]),
         lambda sts: [st["answer"] for st in sts]),
        ("streaming", lambda: few_shot_qa.run(question="What is the capital of Peru?",
                                              stream=True),
         lambda st: "".join(st.text_iter("answer"))),
    ]  # fmt: skip
    failed = 0
    for name, run, show in runs:
        try:
            out = show(run())
            print(f"ok    {name}: {out!r}"[:300])
        except Exception as e:  # report every program, whatever fails
            failed += 1
            print(f"FAIL  {name}: {type(e).__name__}: {e}"[:300])
            traceback.print_exc(limit=3, file=sys.stderr)
    print(f"{len(runs) - failed} of {len(runs)} programs ran")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
