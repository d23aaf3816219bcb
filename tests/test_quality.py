"""The repetition-loop check on token ids: loops of any period up to 1,024 with per-repeat
variation are flagged, in the thinking and in the answer apart; long varied text with repeated
structure is not."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash_pipeline.data.quality import (
    DEFAULT_GATE,
    measure_repetition,
    measure_repetitions,
    repetition_loop,
    response_spans,
    sequence_repetition,
)

REPO = Path(__file__).resolve().parent.parent

# A vocabulary of "word" ids, a range of "digit" ids and a range of counter ids, apart.
WORDS = (1000, 30000)
DIGITS = 10
COUNTER = 100_000
THINK_START, THINK_END = 7, 8


def loop_ids(period: int, repeats: int, variation: str = "exact", seed: int = 0) -> list[int]:
    """A unit of ``period`` random word ids repeated, each repeat varied: ``counter`` (one id
    that is new every repeat), ``sub1``/``sub2`` (one or two ids substituted at random places),
    ``number`` (one slot holds a 1-3 digit number: the unit's length changes by up to 2)."""
    rng = random.Random(seed)
    unit = [rng.randrange(*WORDS) for _ in range(period)]
    out = []
    for r in range(repeats):
        u = list(unit)
        if variation == "counter":
            u[period // 2] = COUNTER + r
        elif variation in ("sub1", "sub2"):
            for _ in range(int(variation[-1])):
                u[rng.randrange(period)] = rng.randrange(*WORDS)
        elif variation == "number":
            u[period // 2 : period // 2 + 1] = [rng.randrange(DIGITS) for _ in range(rng.randint(1, 3))]
        out += u
    return out


def varied_ids(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*WORDS) for _ in range(n)]


LOOPS = [(5, "exact"), (5, "counter")] + [
    (period, variation) for period in (22, 100, 500) for variation in ("counter", "sub1", "sub2", "number")
] + [(1024, "sub2")]


@pytest.mark.parametrize(("period", "variation"), LOOPS, ids=[f"{p}-{v}" for p, v in LOOPS])
def test_loops_of_any_period_with_per_repeat_variation_are_flagged(period, variation):
    ids = loop_ids(period, repeats=max(6, 4000 // period), variation=variation)
    found = repetition_loop(ids)
    assert found is not None
    assert abs(found["period"] - period) <= 2  # a number's digits shift the unit by one or two
    assert found["fraction"] >= 0.95
    assert found["match"] >= (0.79 if period == 5 else 0.85)


def test_the_sentence_loops_that_passed_the_old_check_are_flagged():
    # Issue 14: a 22-token sentence 200 times; an 18-token sentence 150 times (real tokenizer).
    # The old check wanted one 8-gram covering half the tokens: each 8-gram covers 8/22 of them.
    for period, repeats in ((22, 200), (18, 150)):
        found = repetition_loop(loop_ids(period, repeats))
        assert found and found["period"] == period and found["repeats"] == repeats and found["fraction"] == 1.0


def test_a_loop_after_varied_text_counts_by_the_fraction_it_covers():
    loop = loop_ids(22, 100)  # 2,200 tokens
    assert repetition_loop(varied_ids(1500) + loop)["fraction"] == pytest.approx(2200 / 3700, abs=0.03)
    assert repetition_loop(varied_ids(6000) + loop) is None  # 27% of the span: below 0.3
    assert repetition_loop(varied_ids(6000) + loop, min_fraction=0.2)["period"] == 22
    # The first occurrence of the unit counts as part of the loop, not a repeat of it.
    assert 0.26 < measure_repetition(varied_ids(6000) + loop)["fraction"] < 0.3


def test_few_repeats_and_tiny_spans_are_not_loops():
    assert repetition_loop(varied_ids(300) + loop_ids(200, 3) + varied_ids(300, seed=2)) is None  # 3 < 4 repeats
    assert repetition_loop(varied_ids(300) + loop_ids(200, 4) + varied_ids(300, seed=2))["repeats"] >= 3.9
    assert repetition_loop(loop_ids(5, 10)) is None  # 50 tokens: under 64
    assert repetition_loop([]) is None
    assert repetition_loop(varied_ids(5000)) is None


def test_spans_measured_together_are_measured_as_alone():
    """The stage measures a chunk's spans in one pass: no span sees another's tokens."""
    unit = loop_ids(40, 1)
    spans = [
        loop_ids(40, 50),  # a loop...
        unit * 2 + varied_ids(300),  # ...whose unit opens the next span: alone, no loop
        loop_ids(5, 10),  # too short to be measured
        varied_ids(1000, seed=3),
        varied_ids(200, seed=4) + loop_ids(22, 40, "counter"),
        loop_ids(500, 6, "sub2"),
    ]
    together = measure_repetitions(spans)
    assert together == [measure_repetition(span) for span in spans]
    assert [m["period"] for m in together] == [40, 0, 0, 0, 22, 500]


def sequence(prompt: int, thinking: list[int], answer: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = varied_ids(prompt, seed=9) + [THINK_START] + thinking + [THINK_END] + answer + [2]
    mask = [0] * prompt + [1] * (len(ids) - prompt)
    return np.array(ids), np.array(mask)


def test_thinking_and_answer_are_judged_apart():
    cfg = DEFAULT_GATE
    # A long healthy thinking and a looping answer: the whole response is only 11% loop.
    ids, mask = sequence(50, varied_ids(8000), loop_ids(22, 45, "counter"))
    assert measure_repetition(ids[mask.astype(bool)])["fraction"] < 0.15
    found = sequence_repetition(ids, mask, cfg, THINK_START, THINK_END)
    assert found["span"] == "answer" and found["period"] == 22
    # A thinking trace looping with a counter, a healthy answer.
    ids, mask = sequence(50, varied_ids(500) + loop_ids(100, 30, "counter"), varied_ids(200))
    assert sequence_repetition(ids, mask, cfg, THINK_START, THINK_END)["span"] == "thinking"
    # Both healthy.
    ids, mask = sequence(50, varied_ids(3000), varied_ids(300, seed=4))
    assert sequence_repetition(ids, mask, cfg, THINK_START, THINK_END) is None


def test_response_spans_split_each_supervised_run_at_its_think_end():
    ids = np.array([1, THINK_START, 10, 11, THINK_END, 12, 13, 1, 1, 14, 15, 1, 20, 21])
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1])
    spans = [(name, span.tolist()) for name, span in response_spans(ids, mask, THINK_START, THINK_END)]
    assert spans == [
        ("thinking", [THINK_START, 10, 11, THINK_END]),
        ("answer", [12, 13]),
        ("answer", [14, 15]),
        ("answer", [20, 21]),
    ]
    # Cut by the token limit inside the think block (opened in the turn or by the prompt).
    cut = np.array([1, THINK_START, 10, 11])
    for cut_mask in ([0, 1, 1, 1], [0, 0, 1, 1]):
        ((name, _),) = response_spans(cut, np.array(cut_mask), THINK_START, THINK_END)
        assert name == "thinking"
    # A tokenizer without think tokens: everything is the answer.
    assert [name for name, _ in response_spans(ids, mask, None, None)] == ["answer"] * 3


# Negatives: long varied text, some with much repeated structure.

# Eight paragraphs of English prose, wrapped here; one line per paragraph below.
PROSE = """\
The river had been rising for three days before anyone in the village thought to move the grain. By
the time the miller's daughter ran up the hill with the news, water was already lapping at the
threshold of the old granary, and the men who gathered there argued about whether the lower sacks
could be saved at all. Some wanted to form a chain and pass the sacks hand to hand; others insisted
that the cart, though slow, would carry more in a single trip. In the end they did both, and the
work went on past midnight under lanterns that hissed in the drizzle.

Historians of the region tend to treat such episodes as footnotes, but the records of the parish
tell a different story. Floods shaped where families built, which fields were sown with barley
rather than wheat, and even how marriages were arranged between the upland farms and the households
near the water. A careful reading of the ledgers shows that a bad spring could ruin a family for a
generation, while a dry one might let a tenant buy the plot he had worked for twenty years.

Modern engineers approach the same valley with satellite data and hydraulic models. They measure
rainfall upstream, estimate how quickly the soil will saturate, and publish warnings hours before
the water arrives. Yet the basic questions have not changed: what to protect first, whom to
evacuate, and how much risk a community is willing to accept in exchange for living close to fertile
ground. Those questions are political as much as technical, and no model answers them alone.

Consider, for example, the debate over the embankment proposed in the nineteen seventies. Its
supporters pointed to the damage of previous decades and promised that a wall of concrete would end
the problem for good. Opponents worried that the barrier would simply push the flood downstream to
poorer neighbors, and that it would cut the town off from the river that had given it its name. The
council postponed the vote twice, commissioned a study, and finally approved a smaller design that
satisfied nobody completely.

What strikes a visitor today is how ordinary the place looks. There is a bakery on the square, a
school with a painted mural of fish and herons, and a footpath along the bank where joggers pass dog
walkers every morning. Only the marks on the church wall, each labeled with a year, remind people
how high the water once climbed. Children like to stand beneath the highest line and stretch their
arms upward, trying to touch a number that is far out of reach.

Memory, in a town like this, is a practical tool. The older residents know which cellars flood first
and which lanes stay dry; they keep sandbags in their garages and spare batteries in kitchen
drawers. When the sirens sound, they do not wait for official instructions. They carry photographs
upstairs, unplug the freezer, and telephone their cousins on the hill to ask whether there is room
for a few nights. Newcomers learn these habits slowly, usually after their first wet autumn.

Scientists who study climate suggest that such autumns will become more frequent. Warmer air holds
more moisture, storms stall longer over the same catchment, and the ground, baked hard in summer,
absorbs less of the first heavy rain. None of this is certain in its details, but the trend is clear
enough that insurers have begun to adjust their prices. For many households the premium now costs
more than the mortgage, a fact that rarely appears in national statistics.

Perhaps the most interesting response has come from the farmers themselves. Several have agreed to
let their lowest meadows flood on purpose, storing water that would otherwise rush into the streets.
In return they receive a modest payment and the right to graze cattle there during the dry months.
The arrangement is old in spirit, closer to the customs recorded in the parish ledgers than to the
concrete walls of the last century, and it may prove to be the wiser path.
"""


PROSE = re.sub(r"(?<!\n)\n(?!\n)", " ", PROSE)


def demo_traces(count: int = 4) -> list[str]:
    """Long demo reasoning (45-90 problems' column-by-column lines, 2-4k demo tokens): the same
    few line shapes over and over with different digits, lines recurring verbatim."""
    from dflash_pipeline.demo.task import sample_problem

    rng = random.Random(0)
    return ["\n".join(sample_problem(rng).reasoning for _ in range(rng.randint(45, 90))) for _ in range(count)]


def markdown_table(rows: int = 120) -> str:
    rng = random.Random(2)
    cities = ["Berlin", "Paris", "Madrid", "Rome", "Vienna", "Warsaw", "Prague", "Lisbon"]
    lines = ["| Year | City | Population | Area (km2) | Growth |", "|---|---|---|---|---|"]
    for i in range(rows):
        lines.append(f"| {2000 + i % 24} | {rng.choice(cities)} | {rng.randint(100000, 9999999):,} | "
                     f"{rng.uniform(50, 999):.1f} | {rng.uniform(-3, 3):+.2f}% |")
    return "\n".join(lines)


def step_list(steps: int = 150) -> str:
    rng = random.Random(3)
    verbs = ["add", "subtract", "carry", "check", "compare", "write", "multiply", "divide", "round", "verify"]
    things = ["the ones column", "the tens digit", "the partial sum", "the remainder", "both operands",
              "the carry bit", "the final result", "the estimate"]
    return "\n".join(
        f"Step {i}: {rng.choice(verbs)} {rng.choice(things)}, giving {rng.randint(0, 9999)}; "
        f"then {rng.choice(verbs)} {rng.choice(things)}." for i in range(1, steps + 1)
    )


def code() -> str:
    return "\n".join((REPO / "dflash_pipeline" / "data" / name).read_text() for name in ("masks.py", "tokenized.py"))


def word_ids(text: str) -> list[int]:
    """Word-level ids (one id per distinct word): closer to a real tokenizer's than bytes."""
    vocab: dict[str, int] = {}
    return [vocab.setdefault(w, len(vocab)) for w in text.split()]


@pytest.fixture(scope="module")
def tok(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def negatives(tok) -> dict[str, list[int]]:
    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    out = {f"demo_trace_{i}": encode(t) for i, t in enumerate(demo_traces())}
    out["demo_traces_joined"] = encode("\n\n".join(demo_traces(8)))
    out["prose"] = encode(PROSE)
    out["prose_words"] = word_ids(PROSE)
    out["code"] = encode(code())
    out["code_bytes"] = list(code().encode())
    for name, text in (("table", markdown_table()), ("steps", step_list())):
        out[name] = encode(text)
        out[f"{name}_bytes"] = list(text.encode())
    return out


def test_long_varied_text_with_repeated_structure_is_not_a_loop(tok):
    for name, ids in negatives(tok).items():
        assert len(ids) > 2000 or name == "prose_words", name
        assert measure_repetition(ids)["fraction"] == 0, name
        # Margin: not even with a looser threshold (measured: the most loop-like, the byte-level
        # table, reaches 0.3 coverage at min_match 0.65; the weakest loop above, period 5 with a
        # counter, loses it above 0.80).
        assert repetition_loop(ids, min_match=0.7) is None, name


def test_a_loop_in_demo_text_is_flagged(tok):
    """The positive counterpart of the demo traces: the same trace text, repeated with a counter."""
    unit = "\n".join(demo_traces(1)[0].split("\n")[:24])
    text = "\n".join(f"Attempt {r}:\n{unit}" for r in range(8))
    found = repetition_loop(tok(text, add_special_tokens=False)["input_ids"])
    assert found and found["fraction"] > 0.95 and found["repeats"] >= 7


def generated_row(i, content, reasoning):
    from tests.test_tokenize import generated_row as row

    return row(i, content, reasoning)


def test_the_stage_flags_loops_in_the_thinking_and_the_answer_and_reports_them(tok):
    from dflash_pipeline.data.quality import DegenerateShard
    from dflash_pipeline.data.tokenized import ShardTokenizer
    from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA

    traces = demo_traces(12)
    rows = [generated_row(i, f"The answer is {i}.", traces[i]) for i in range(12)]  # long healthy thinking
    sentence = "So the sum of the two numbers is the same as before, and nothing changes."
    rows.append(generated_row(50, " ".join([sentence] * 60), traces[0]))  # looping answer
    attempt = "Wait, let me recompute the ones column once more to be sure: 7+8=15, write 5 carry 1."
    counted = "\n".join(f"({r}) {attempt}" for r in range(80))
    rows.append(generated_row(51, "It is 15.", counted))  # a looping thinking trace, with a counter
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    settings = {"max_length": 16384, "max_degenerate_fraction": 0.5}
    _, stats = ShardTokenizer(tok, thinking=True, settings=settings).run(table, "g")
    assert stats["examples"]["repetition_loop"] == ["s50", "s51"]
    rep = stats["repetition"]
    assert rep["settings"] == {key: DEFAULT_GATE[key] for key in rep["settings"]} and len(rep["settings"]) == 4
    assert rep["flagged_sequences"] == 2 and rep["flagged_spans"] == {"answer": 1, "thinking": 1}
    by_id = {loop["id"]: loop for loop in rep["examples"]}
    assert by_id["s50"]["span"] == "answer" and by_id["s51"]["span"] == "thinking"
    assert all(loop["fraction"] > 0.9 and loop["match"] > 0.9 for loop in by_id.values())
    # The same shard with a stricter degenerate limit fails, the message giving the thresholds
    # and the measurements.
    with pytest.raises(DegenerateShard) as err:
        ShardTokenizer(tok, thinking=True, settings={**settings, "max_degenerate_fraction": 0.1}).run(table, "g")
    message = str(err.value)
    assert "repetition_loop 2" in message
    assert "tokenize.repetition_max_period=1024, tokenize.repetition_min_match=0.75" in message
    assert f"s50 answer: period {by_id['s50']['period']} x " in message and "s51 thinking: period" in message
