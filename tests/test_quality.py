"""The data-quality gate. The repetition-loop check on token ids: loops of any period up to
1,024 with per-repeat variation are flagged, in the thinking and in the answer apart; long varied
text with repeated structure is not. The gate's verdict and message on a shard, judged directly
and through the tokenize stage: the degenerate reasons counted, the shard failed naming its cause."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash_pipeline.data.quality import DEFAULT_GATE, DegenerateShard
from dflash_pipeline.data.tokenized import ShardTokenizer
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from dflash_pipeline.data.repetition import (
    measure_repetition,
    measure_repetitions,
    repetition_loop,
    response_spans,
    sequence_repetition,
)
from tests.support.generated_rows import generated_row, healthy

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


LOOPS = (
    [(5, "exact"), (5, "counter")]
    + [(period, variation) for period in (22, 100, 500) for variation in ("counter", "sub1", "sub2", "number")]
    + [(1024, "sub2")]
)


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
        lines.append(
            f"| {2000 + i % 24} | {rng.choice(cities)} | {rng.randint(100000, 9999999):,} | "
            f"{rng.uniform(50, 999):.1f} | {rng.uniform(-3, 3):+.2f}% |"
        )
    return "\n".join(lines)


def step_list(steps: int = 150) -> str:
    rng = random.Random(3)
    verbs = ["add", "subtract", "carry", "check", "compare", "write", "multiply", "divide", "round", "verify"]
    things = [
        "the ones column",
        "the tens digit",
        "the partial sum",
        "the remainder",
        "both operands",
        "the carry bit",
        "the final result",
        "the estimate",
    ]
    return "\n".join(
        f"Step {i}: {rng.choice(verbs)} {rng.choice(things)}, giving {rng.randint(0, 9999)}; "
        f"then {rng.choice(verbs)} {rng.choice(things)}."
        for i in range(1, steps + 1)
    )


def code() -> str:
    return "\n".join(
        (REPO / "dflash_pipeline" / "data" / name).read_text() for name in ("loss_masks.py", "tokenized.py")
    )


def word_ids(text: str) -> list[int]:
    """Word-level ids (one id per distinct word): closer to a real tokenizer's than bytes."""
    vocab: dict[str, int] = {}
    return [vocab.setdefault(w, len(vocab)) for w in text.split()]


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


def test_the_stage_flags_loops_in_the_thinking_and_the_answer_and_reports_them(tok):
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
    # The same shard with a stricter degenerate limit fails (two loops are enough to judge by
    # here), the message giving the thresholds and the measurements.
    strict = {**settings, "max_degenerate_fraction": 0.1, "min_degenerate_rows": 2}
    with pytest.raises(DegenerateShard) as err:
        ShardTokenizer(tok, thinking=True, settings=strict).run(table, "g")
    message = str(err.value)
    assert "repetition_loop 2" in message
    assert "tokenize.repetition_max_period=1024, tokenize.repetition_min_match=0.75" in message
    assert f"s50 answer: period {by_id['s50']['period']} x " in message and "s51 thinking: period" in message


# --- the gate's verdict and its message ----------------------------------------------------------
#
# The gate judged directly (``gate_shard``) on generated rows and stand-ins of their tokenized
# sequences: a row's supervised tokens are the characters of its response, so "OK." after an
# empty think block is too_few_supervised, as the real tokenizer makes it (tests/test_tokenize.py).


@dataclass
class FakeSequence:
    supervised: int
    input_ids: list
    turn: int = -1
    truncated: bool = False
    round_trip_ok: bool = True
    fell_back: bool = False
    repetition: dict | None = None


def healthy_row(i: int, **kw) -> dict:
    return generated_row(
        i,
        f"So {i} + {i} = {2 * i}, as the ones column shows.",
        f"Add the ones: {i % 10} + {i % 10}; carry where needed; {i} + {i} = {2 * i}.",
        **kw,
    )


def judge(rows: list[dict], sampling: dict | None = None, mismatched: tuple[str, ...] = (), **settings):
    """``gate_shard`` with the default settings (and ``settings``); ``mismatched`` ids: template
    mismatches."""
    from dflash_pipeline.data.quality import gate_shard, row_checks

    cfg = {**DEFAULT_GATE, **settings}
    checks = {r["id"]: row_checks(r) for r in rows}
    encoded = {}
    for r in rows:
        if r["error"] is not None:
            continue
        if r["id"] in mismatched:
            encoded[r["id"]] = "the template's renderings do not extend each other"
            continue
        message = r["messages"][-1]
        n = len((message["reasoning_content"] or "") + message["content"])
        encoded[r["id"]] = [FakeSequence(supervised=n, input_ids=[0] * (n + 10))]
    return gate_shard(rows, checks, encoded, cfg, "generate-00003.parquet", False, sampling)


def fingerprint_of(temperature: float, seed: int | None = 0, max_new_tokens: int = 4096) -> str:
    """A fingerprint as the generate stage writes it (``regenerate.fingerprint``)."""
    from dflash_pipeline.engines.client import Sampling
    from dflash_pipeline.engines.regenerate import GenerationSettings, fingerprint

    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=0.95, seed=seed)
    return fingerprint(
        "/models/none", "{{ template }}", GenerationSettings(thinking=True, sampling=sampling), "sglang", "0.5.17"
    )


def seeds_like(total: int, degenerate: int, fingerprint: str = "f") -> list[dict]:
    """The incident's shard: an empty think block and "OK." for ``degenerate`` of ``total`` prompts."""
    return [healthy_row(i, fingerprint=fingerprint) for i in range(total - degenerate)] + [
        generated_row(1000 + i, "OK.", "", fingerprint=fingerprint) for i in range(degenerate)
    ]


def test_the_new_key_is_in_the_schema_with_the_gates_default():
    from dflash_pipeline.core.config import load_schema
    from dflash_pipeline.data.tokenized import DEFAULTS

    schema = load_schema()["properties"]["tokenize"]["properties"]
    assert (
        schema["min_degenerate_rows"]["default"]
        == DEFAULT_GATE["min_degenerate_rows"]
        == DEFAULTS["min_degenerate_rows"]
        == 5
    )
    for key, value in DEFAULT_GATE.items():
        assert schema[key]["default"] == value, key


def test_one_odd_sample_of_a_13_sample_trial_passes():
    rows = [healthy_row(i) for i in range(12)] + [generated_row(50, " ", "")]  # one empty response
    kept, summary = judge(rows)
    assert (
        summary["degenerate_samples"] == 1 and summary["degenerate_fraction"] > DEFAULT_GATE["max_degenerate_fraction"]
    )
    assert summary["gate"] == {
        "max_degenerate_fraction": 0.05,
        "min_degenerate_rows": 5,
        "verdict": "passed: too few degenerate samples to judge",
    }
    assert len(kept) == 12 and "s50" not in {row["id"] for row, _ in kept}  # passed without it
    # Four of 13 still pass; the fifth is evidence.
    rows = [healthy_row(i) for i in range(9)] + [generated_row(50 + i, " ", "") for i in range(4)]
    assert judge(rows)[1]["degenerate_samples"] == 4
    rows = [healthy_row(i) for i in range(8)] + [generated_row(50 + i, " ", "") for i in range(5)]
    with pytest.raises(DegenerateShard):
        judge(rows)
    # min_degenerate_rows 1: the fraction alone decides, as before the key.
    with pytest.raises(DegenerateShard):
        judge([healthy_row(i) for i in range(12)] + [generated_row(50, " ", "")], min_degenerate_rows=1)
    # Below the fraction, any count passes.
    rows = [healthy_row(i) for i in range(200)] + [generated_row(500 + i, " ", "") for i in range(10)]
    assert judge(rows)[1]["gate"]["verdict"] == "passed"


@pytest.mark.parametrize("total", [6, 13, 100, 2255])
def test_a_seeds_like_shard_fails_at_any_size_from_six_samples(total):
    degenerate = round(0.87 * total)
    with pytest.raises(DegenerateShard) as err:
        judge(seeds_like(total, degenerate))
    assert err.value.summary["degenerate_samples"] == degenerate
    assert err.value.summary["gate"]["verdict"] == "failed"
    assert f"{degenerate} of {total} samples" in str(err.value)
    assert "tokenize.min_degenerate_rows=5" in str(err.value)


def test_the_seeds_incident_names_greedy_generation_and_off_domain_prompts():
    with pytest.raises(DegenerateShard) as err:
        judge(seeds_like(100, 87, fingerprint=fingerprint_of(0.0)))
    message, cause = str(err.value), err.value.cause
    assert "87 of 100 samples (87.0%) are degenerate" in message
    assert "Most common response (87 times): ' | OK.'." in message
    assert "most common response, 87 times: ' | OK.'" in cause
    assert "likely causes: off-domain prompts, greedy generation)" in cause
    assert "What to do: Many prompts got an empty, a too short or the same answer" in message
    assert "filter them out of dataset.paths" in message
    assert (
        "The generation is greedy (temperature 0): regenerating with the same settings gives the same text" in message
    )
    assert "samples at temperature" not in message and "Raise generation.max_new_tokens" not in message
    assert err.value.summary["sampling"]["temperature"] == 0.0  # read from the rows' fingerprints


def test_sampled_and_unknown_generation_get_their_own_advice():
    with pytest.raises(DegenerateShard) as err:
        judge(seeds_like(100, 87, fingerprint=fingerprint_of(0.6, seed=0)))
    message = str(err.value)
    assert "The generation samples at temperature 0.6 with generation.seed 0 sent with every request" in message
    assert "greedy" not in message
    with pytest.raises(DegenerateShard) as err:
        judge(seeds_like(100, 87, fingerprint=fingerprint_of(0.6, seed=None)))
    assert "regenerating draws new samples from the same distribution" in str(err.value)
    # No fingerprint to read: neither greedy nor sampled is presumed.
    with pytest.raises(DegenerateShard) as err:
        judge(seeds_like(100, 87))
    message = str(err.value)
    assert err.value.summary["sampling"] is None
    assert "greedy (temperature 0)" not in message and "samples at temperature" not in message
    assert "regenerating with the same settings gives the same kind of output" in message
    # The caller's sampling settings win over the fingerprints.
    with pytest.raises(DegenerateShard) as err:
        judge(seeds_like(100, 87, fingerprint=fingerprint_of(0.6)), sampling={"temperature": 0})
    assert "The generation is greedy" in str(err.value)


def test_a_template_problem_is_not_advised_to_regenerate():
    rows = [healthy_row(i, fingerprint=fingerprint_of(0.0)) for i in range(40)]
    with pytest.raises(DegenerateShard) as err:
        judge(rows, mismatched=tuple(f"s{i}" for i in range(10)))
    message = str(err.value)
    assert "template_mismatch 10" in message
    assert "What to do: A chat template problem (10 template_mismatch)" in message
    assert "regenerating gives the same mismatch" in message
    assert "greedy" not in message and "off-domain" not in message and "Raise generation" not in message
    assert "likely cause: a chat template problem" in err.value.cause


def test_a_length_cut_is_advised_to_raise_max_new_tokens():
    # max_new_tokens 8: every trace cut short, too few supervised tokens to train on.
    fp = fingerprint_of(0.6, max_new_tokens=8)
    rows = [healthy_row(i, fingerprint=fp) for i in range(30)]
    rows += [
        generated_row(100 + i, "", f"Let me {i}", finish="length", closed=False, fingerprint=fp) for i in range(10)
    ]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    message = str(err.value)
    summary = err.value.summary
    assert summary["length_cut"] == {"samples": 10, "reasons": {"too_few_supervised": 10}}
    assert (
        "What to do: A length cut: 10 degenerate samples were cut by the token limit (finish_reason length). "
        "Raise generation.max_new_tokens (now 8), and the server's context length with it"
    ) in message
    # The cut explains the short answers: no advice on the prompts or the sampling.
    assert "off-domain" not in message and "samples at temperature" not in message
    assert "likely cause: a length cut)" in err.value.cause
    # Thinking that never closed although the engine said stop: the same advice.
    rows = [healthy_row(i, fingerprint=fp) for i in range(30)]
    rows += [
        generated_row(100 + i, "", f"Let me think about {i} for a while", closed=False, fingerprint=fp)
        for i in range(10)
    ]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    assert "think_not_closed 10" in str(err.value)
    assert "A length cut: 10 ended inside the thinking (think_not_closed" in str(err.value)


def test_engine_errors_are_advised_to_fix_the_engine():
    rows = [healthy_row(i) for i in range(30)] + [generated_row(100 + i, "", "", error="timed out") for i in range(8)]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    message = str(err.value)
    assert "What to do: The engine gave no response for 8 samples (generation_error)" in message
    assert "Most common response" not in message  # 30 different answers


def test_the_most_common_response_is_quoted_only_when_it_is_common():
    # Six different short answers: the "most common" of them was given once.
    rows = [healthy_row(i) for i in range(14)] + [generated_row(100 + i, f"No {i}.", "") for i in range(6)]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    summary = err.value.summary
    assert summary["most_common_response"]["count"] == 1 and summary["most_common_response"]["common"] is False
    assert "Most common response" not in str(err.value) and "most common response" not in err.value.cause
    # Twice in 20: still chance.
    rows = [healthy_row(i) for i in range(14)] + [generated_row(100 + i, f"No {i // 2}.", "") for i in range(6)]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    assert err.value.summary["most_common_response"]["count"] == 2 and "Most common response" not in str(err.value)
    # Three times in a 13-sample trial: quoted.
    rows = [healthy_row(i) for i in range(7)] + [generated_row(100 + i, "No.", "") for i in range(3)]
    rows += [generated_row(200 + i, f"Hm {i}.", "") for i in range(3)]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    assert "Most common response (3 times): ' | No.'." in str(err.value)
    assert "most common response, 3 times: ' | No.'" in err.value.cause
    # In a large shard, 3 of 2,000 is no share (1% is 20): not quoted.
    rows = [healthy_row(i) for i in range(1880)] + [generated_row(5000 + i, "No.", "") for i in range(3)]
    rows += [generated_row(6000 + i, f"Hm {i}.", "") for i in range(117)]
    with pytest.raises(DegenerateShard) as err:
        judge(rows)
    assert err.value.summary["most_common_response"]["count"] == 3
    assert "Most common response" not in str(err.value)


def test_the_sampling_is_read_from_the_rows_fingerprints():
    from dflash_pipeline.data.quality import generation_sampling

    fp = fingerprint_of(0.0, seed=7, max_new_tokens=512)
    rows = [healthy_row(i, fingerprint=fp) for i in range(3)]
    assert generation_sampling(rows) == {"max_new_tokens": 512, "temperature": 0.0, "top_p": 0.95, "seed": 7}
    assert generation_sampling([healthy_row(0)]) is None  # no fingerprint payload
    assert generation_sampling([{**rows[0], "fingerprint": None}]) is None
    assert generation_sampling(rows + [healthy_row(9, fingerprint=fingerprint_of(0.6))]) is None  # rows disagree


def test_a_13_sample_trial_with_one_odd_sample_passes_the_stage(tok):
    """Through the tokenize stage with the demo tokenizer: the trial run that used to halt."""
    rows = [healthy(i) for i in range(12)] + [generated_row(50, "", "")]
    out, stats = ShardTokenizer(tok, thinking=True).run(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), "g")
    assert stats["degenerate_samples"] == 1 and stats["reasons"]["empty_response"] == 1
    assert stats["gate"]["verdict"] == "passed: too few degenerate samples to judge"
    assert out.num_rows == 12 and "s50" not in out.column("id").to_pylist()


# --- the gate through the tokenize stage (``ShardTokenizer``) with the demo tokenizer ------------


def test_a_shard_like_the_seed_incident_fails_naming_the_cause(tok):
    rows = [healthy(i) for i in range(13)]
    rows += [generated_row(100 + i, "OK.", "") for i in range(87)]
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    with pytest.raises(DegenerateShard) as err:
        ShardTokenizer(tok, thinking=True).run(table, "generated-00007.parquet")
    message = str(err.value)
    assert "generated-00007.parquet: 87 of 100 samples (87.0%) are degenerate" in message
    assert "identical_response 87" in message and "too_few_supervised 87" in message
    assert "s100" in message
    assert "Most common response (87 times): ' | OK.'" in message


def test_a_healthy_shard_passes_and_counts_cut_traces_without_failing(tok):
    rows = [healthy(i) for i in range(40)]
    rows.append(generated_row(99, "", "1+1=2, write 2\n" * 3, finish="length", closed=False))
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    out, stats = ShardTokenizer(tok, thinking=True).run(table, "g")
    assert stats["degenerate_samples"] == 0 and out.num_rows == 41
    assert stats["finish_reasons"] == {"stop": 40, "length": 1}
    assert all(
        sum(m) == n for m, n in zip(out.column("loss_mask").to_pylist(), out.column("num_supervised").to_pylist())
    )


def test_each_degenerate_reason_is_counted(tok):
    loop = "1+1=2, write 2 " * 40
    rows = [healthy(i) for i in range(60)]
    rows += [
        generated_row(200, "", "", error="gave up after 6 attempts"),
        generated_row(201, "  ", ""),
        generated_row(202, "x", "never closed", closed=False),
        generated_row(203, "ok", loop),
    ]
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    _, stats = ShardTokenizer(tok, thinking=True, settings={"max_degenerate_fraction": 0.5}).run(table, "g")
    assert stats["examples"]["generation_error"] == ["s200"]
    assert stats["examples"]["empty_response"] == ["s201"]
    assert stats["examples"]["think_not_closed"] == ["s202"]
    assert stats["examples"]["repetition_loop"] == ["s203"]
    assert stats["degenerate_samples"] == 4


def test_special_token_in_text_is_a_default_reason_counted_in_the_stats_and_the_report(tok, tmp_path):
    import xml.etree.ElementTree as ET

    from dflash_pipeline.core.config import load_schema
    from dflash_pipeline.data.quality import DEFAULT_GATE, DEGENERATE_REASONS
    from dflash_pipeline.report import figures, tables

    schema = load_schema()
    setting = schema["properties"]["tokenize"]["properties"]["degenerate_reasons"]
    assert setting["default"] == DEFAULT_GATE["degenerate_reasons"] == sorted(DEGENERATE_REASONS)
    assert sorted(setting["items"]["enum"]) == sorted(DEGENERATE_REASONS)
    assert "special_token_in_text" in DEFAULT_GATE["degenerate_reasons"]

    rows = [healthy(i) for i in range(40)] + [generated_row(99, "Stop at <|im_end|> here.", "think")]
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    out, stats = ShardTokenizer(tok, thinking=True).run(table, "generate-00000.parquet")
    assert stats["reasons"] == {"special_token_in_text": 1} and stats["degenerate_samples"] == 1
    assert out.num_rows == 40 and "s99" not in out.column("id").to_pylist()
    figures.plot_degenerate_reasons([stats], tmp_path / "deg.svg")
    assert "special_token_in_text" in " ".join(ET.parse(tmp_path / "deg.svg").getroot().itertext())
    tables.write_tokenization_table([stats], tmp_path / "tok.html")
    assert "special_token_in_text 1" in (tmp_path / "tok.html").read_text()
