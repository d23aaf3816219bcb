"""Metrics, gates, prompt reading and the SGLang mode of the evaluation, as plain Python."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_pipeline.engines.launch import sglang_command
from dflash_pipeline.evaluation.lossless import (
    compare_greedy,
    failure_message,
    lossless_summary,
)
from dflash_pipeline.evaluation.loop import PlainTrace, SpeculativeTrace
from dflash_pipeline.evaluation.metrics import (
    PromptResult,
    accept_histogram,
    aggregate,
    metrics_document,
    per_position_acceptance,
)
from dflash_pipeline.evaluation.parity import ParityError, check_parity, parity_report
from dflash_pipeline.evaluation.prompts import PromptFileError, read_eval_prompts
from dflash_pipeline.evaluation.engine_counters import EngineResponseError, acceptance_from_response
from dflash_pipeline.evaluation.engine_requests import prompt_result, request_acceptance
from dflash_pipeline.evaluation.serving import serving_server_spec


def result(pid, prompt_set, accepted, block=4, seconds=None, plain=None):
    trace = SpeculativeTrace(
        tokens=list(range(1 + sum(a + 1 for a in accepted))),
        accepted_lengths=accepted,
        block_size=block,
        finish_reason="length",
        seconds=seconds or 1.0,
    )
    return PromptResult.from_traces(pid, prompt_set, 10, trace, plain)


def test_histogram_and_per_position_acceptance_follow_their_definitions():
    hist = accept_histogram([0, 3, 1, 3, 2], block_size=4)
    assert hist == [1, 1, 1, 2]
    # draft k accepted when A >= k: k=1 in 4 of 5 steps, k=2 in 3, k=3 in 2.
    assert per_position_acceptance(hist) == [0.8, 0.6, 0.4]
    with pytest.raises(ValueError, match="accepted length 4 outside 0..3"):
        accept_histogram([4], block_size=4)


def test_prompt_tau_is_committed_tokens_per_verify_step():
    r = result("a", "math", [3, 3, 1])
    assert r.committed_tokens == 4 + 4 + 2
    assert r.tau == pytest.approx(10 / 3)
    assert r.generated_tokens == 11  # the first token came from prefill, not a verify step
    row = r.as_dict()
    assert row["accept_hist"] == [0, 1, 0, 2] and row["verify_steps"] == 3


def test_groups_weight_tau_by_steps_and_split_by_prompt_set():
    results = [
        result("a", "math", [3, 3]),
        result("b", "chat", [0, 0, 0, 1]),
        result("c", "math", [1]),
    ]
    overall = aggregate(results)
    assert overall["tau"] == pytest.approx((4 + 4 + 1 + 1 + 1 + 2 + 2) / 7, abs=1e-4)
    assert overall["tau_mean_of_prompts"] == pytest.approx((4 + 1.25 + 2) / 3, abs=1e-4)
    assert overall["accept_hist"] == [3, 2, 0, 2]
    assert overall["verify_steps"] == 7
    doc = metrics_document(results, {"block_size": 4}, lossless={"checked": False})
    assert set(doc["prompt_sets"]) == {"math", "chat"}
    assert doc["prompt_sets"]["math"]["tau"] == pytest.approx((4 + 4 + 2) / 3, abs=1e-4)
    assert doc["prompt_sets"]["chat"]["accept_hist"] == [3, 1, 0, 0]
    assert [p["id"] for p in doc["per_prompt"]] == ["a", "b", "c"]
    assert doc["per_prompt"][1]["prompt_set"] == "chat"
    json.dumps(doc)  # the document is plain JSON


def test_speedup_is_plain_time_per_token_over_loop_time_per_token():
    plain = PlainTrace(tokens=list(range(9)), finish_reason="length", seconds=0.9)
    r = result("a", "s", [3, 3], seconds=0.3, plain=plain)  # 9 tokens in 0.3 s vs 0.9 s
    assert aggregate([r])["speedup_estimate"] == pytest.approx(3.0)
    assert aggregate([result("b", "s", [1])])["speedup_estimate"] is None  # no plain timing


def test_lossless_compare_reports_the_first_divergence_with_the_targets_margin():
    margins = [5.0, 4.0, 0.1, 3.0]
    exact = compare_greedy([1, 2, 3, 4], [1, 2, 3, 4], margins, 0.0)
    assert exact.passed and exact.verdict == "exact"
    near = compare_greedy([1, 2, 9, 9], [1, 2, 3, 4], margins, 0.25)
    assert near.first_divergence == 2 and near.margin == 0.1 and near.verdict == "near_tie"
    fp32 = compare_greedy([1, 2, 9, 9], [1, 2, 3, 4], margins, 0.0)
    assert not fp32.passed  # in fp32 any difference fails
    clear = compare_greedy([1, 9, 3, 4], [1, 2, 3, 4], margins, 0.25)
    assert clear.verdict == "lost" and clear.loop_token == 9 and clear.plain_token == 2
    shorter = compare_greedy([1, 2], [1, 2, 3, 4], margins, 0.25)
    assert shorter.first_divergence == 2 and shorter.loop_token is None
    summary = lossless_summary({"p1": exact, "p2": near, "p3": clear}, 0.25)
    assert summary["exact"] == 1 and set(summary["near_ties"]) == {"p2"}
    assert set(summary["failures"]) == {"p3"} and not summary["passed"]
    assert (summary["near_tie"], summary["lost"]) == (1, 1)
    message = failure_message(summary)
    assert "prompt p3: first divergence at generated token 1: loop 9 vs plain 2" in message


def test_parity_gate_passes_within_tolerance_and_names_causes_outside():
    assert parity_report(4.0, 3.5)["passed"]  # 12.5% gap, default tolerance 15%
    assert check_parity(4.0, 3.5)["gap"] == pytest.approx(-0.125)
    with pytest.raises(ParityError) as below:
        check_parity(4.0, 3.0)
    text = str(below.value)
    assert "25% below the simulated tau 4.000" in text
    for cause in (
        "chat template or thinking",
        "layer ids off by one",
        "RoPE",
        "skipped",
        "sliding-window",
    ):
        assert cause in text
    with pytest.raises(ParityError, match="above the simulated tau"):
        check_parity(2.0, 3.0, tolerance=0.2)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" if not isinstance(r, str) else r + "\n" for r in rows))
    return path


def test_prompts_are_read_with_ids_sets_and_without_trailing_assistant_turns(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "q1", "prompt_set": "math", "messages": [{"role": "user", "content": "1+1?"}]},
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            },
            {"conversations": [{"from": "human", "value": "2+2?"}], "id": 7},
        ],
    )
    prompts = read_eval_prompts(path)
    assert [p.prompt_set for p in prompts] == ["math", "default", "default"]
    assert prompts[0].id == "q1" and prompts[2].id == "7"
    assert len(prompts[1].id) == 20  # hash of the prompt turns
    assert prompts[1].messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert len(read_eval_prompts(path, limit=2)) == 2


def test_prepared_parquet_prompts_are_selected_by_split_and_grouped_by_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.stages.prepare import PROMPT_SCHEMA

    def row(pid, split, source):
        messages = [{"role": "user", "content": f"question {pid}"}]
        return {"id": pid, "shard": 0, "split": split, "messages": messages, "source": source}

    rows = [
        row("a", "heldout", "data/gsm8k.jsonl:3"),
        row("b", "train", "data/gsm8k.jsonl:4"),
        row("c", "heldout", "s3://bucket/chat/sharegpt.parquet:9"),
    ]
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA), path)
    heldout = read_eval_prompts(path, split="heldout")
    assert [(p.id, p.prompt_set) for p in heldout] == [("a", "gsm8k"), ("c", "sharegpt")]
    assert len(read_eval_prompts(path)) == 3
    with pytest.raises(PromptFileError, match="has no rows in split 'test'"):
        read_eval_prompts(path, split="test")
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(PromptFileError, match=r"p.jsonl row 1: no `split` field"):
        read_eval_prompts(jsonl, split="heldout")


@pytest.mark.parametrize(
    "rows, message",
    [
        (['{"messages": [}'], r"p.jsonl row 1: malformed JSON"),
        (
            [{"messages": [{"role": "user", "content": "a"}]}, {"messages": []}],
            r"p.jsonl row 2: empty",
        ),
        ([{"messages": [{"role": "assistant", "content": "a"}]}], r"row 1: no user turn"),
        (
            [
                {"id": "x", "messages": [{"role": "user", "content": "a"}]},
                {"id": "x", "messages": [{"role": "user", "content": "b"}]},
            ],
            r"row 2: id 'x' repeats row 1",
        ),
        ([], r"has no rows"),
    ],
)
def test_bad_prompt_files_name_file_row_and_reason(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(PromptFileError, match=message):
        read_eval_prompts(path)


def test_sglang_is_launched_with_the_dflash_drafter_and_hybrid_rollback():
    spec = serving_server_spec(
        "sglang", "/m/target", "/m/drafter", 16, 31000, hybrid=True, tp=2, python="/s/bin/python"
    )
    cmd = sglang_command(spec)
    joined = " ".join(cmd)
    assert "--speculative-algorithm DFLASH" in joined
    assert "--speculative-draft-model-path /m/drafter" in joined
    assert "--speculative-num-draft-tokens 16" in joined
    assert "--speculative-dflash-block-size 16" in joined
    assert "--mamba-radix-cache-strategy extra_buffer" in joined
    assert "--tp-size 2" in joined and "--port 31000" in joined
    dense = " ".join(sglang_command(serving_server_spec("sglang", "/t", "/d", 8, 31000, hybrid=False, python="p")))
    assert "mamba" not in dense and "--speculative-dflash-block-size 8" in dense


def test_sglang_acceptance_is_read_from_meta_info_and_counted_as_the_loop_counts():
    # 10 verify steps accepting 0, 1, 2 drafts 2, 3, 5 times commit 2 + 6 + 15 = 23 tokens; the
    # reply has 22: the first token came from prefill, and 2 committed tokens lay past the stop.
    reply = {
        "text": "...",
        "output_ids": [5, 6, 7],
        "meta_info": {
            "completion_tokens": 22,
            "spec_verify_ct": 10,
            "spec_num_correct_drafts": 13,
            "spec_correct_drafts_histogram": [2, 3, 5],
            "finish_reason": {"type": "stop"},
        },
    }
    acceptance = acceptance_from_response(reply, block_size=4)
    assert acceptance.accept_hist == [2, 3, 5, 0]
    record = prompt_result("p", "s", 12, acceptance, 4)
    # The loop's tau (A + 1 per verify step), not SGLang's completion_tokens / spec_verify_ct (2.2).
    assert record.tau == 2.3 and record.verify_steps == 10 and record.generated_tokens == 22
    older = {"meta_info": {"completion_tokens": 9, "spec_verify_ct": 3, "spec_accept_histogram": [1, 2]}}
    assert acceptance_from_response(older, 4).accept_hist == [1, 2, 0, 0]
    assert acceptance_from_response(older, 4).committed_tokens == 5
    counts_only = {"meta_info": {"completion_tokens": 9, "spec_verify_ct": 3, "spec_num_correct_drafts": 4}}
    assert acceptance_from_response(counts_only, 4).committed_tokens == 7
    bare = {"meta_info": {"completion_tokens": 9, "spec_verify_ct": 3}}
    assert acceptance_from_response(bare, 4).accept_hist is None
    assert acceptance_from_response(bare, 4).committed_tokens == 9  # all an old SGLang gives


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"completion_tokens": 9}, "spec_verify_ct missing .* without speculative decoding"),
        (
            {"completion_tokens": 9, "spec_verify_ct": 3, "spec_accept_histogram": [1, 1]},
            "counts 2 steps",
        ),
        (
            {"completion_tokens": 9, "spec_verify_ct": 2, "spec_accept_histogram": [1, 0, 0, 0, 1]},
            "4 or fewer",
        ),
    ],
)
def test_sglang_replies_without_usable_counters_are_refused(meta, message):
    with pytest.raises(EngineResponseError, match=message):
        acceptance_from_response({"meta_info": meta}, 4, source="prompt q7")
    with pytest.raises(EngineResponseError, match="prompt q7: SGLang reply has no meta_info"):
        acceptance_from_response({}, 4, source="prompt q7")


class StandInSglang(BaseHTTPRequestHandler):
    """SGLang's ``/generate`` as far as the evaluation uses it (SGLang itself cannot run here):
    checks the request and answers with counters derived from the prompt length."""

    requests: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandInSglang.requests.append({"path": self.path, **body})
        steps = len(body["input_ids"])
        reply = {
            "text": "",
            "output_ids": [1] * (3 * steps),
            "meta_info": {
                "completion_tokens": 3 * steps,
                "spec_verify_ct": steps,
                # two drafts accepted every step: 3 tokens committed per step (the reply has
                # the same count: one from prefill, one committed past the token limit)
                "spec_correct_drafts_histogram": [0, 0, steps],
                "finish_reason": {"type": "length"},
            },
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_sglang_mode_sends_prompt_ids_and_reads_acceptance_per_prompt():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInSglang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        prompts = [("p1", "math", [5, 6, 7, 8]), ("p2", "chat", [9, 10])]
        results, outputs = request_acceptance(
            "sglang", url, prompts, 4, model="/m/target", max_new_tokens=64, temperature=0.0
        )
    finally:
        server.shutdown()
        server.server_close()
    sent = sorted(StandInSglang.requests, key=lambda r: len(r["input_ids"]))
    assert [r["path"] for r in sent] == ["/generate", "/generate"]
    assert [r["input_ids"] for r in sent] == [[9, 10], [5, 6, 7, 8]]
    assert sent[0]["sampling_params"]["max_new_tokens"] == 64
    assert sent[0]["sampling_params"]["temperature"] == 0.0
    by_id = {r.id: r for r in results}
    assert by_id["p1"].tau == 3.0 and by_id["p1"].verify_steps == 4
    assert by_id["p1"].accept_hist == [0, 0, 4, 0] and by_id["p2"].prompt_set == "chat"
    assert aggregate(results)["tau"] == 3.0
    assert outputs == {"p1": [1] * 12, "p2": [1] * 6}


def test_held_out_prompts_are_read_from_the_ingested_table_by_row_group_until_the_limit(store, tmp_path):
    """Evaluate reads the run's ingested table where it lies (local or S3) by byte range: with a
    limit it stops after the row groups that hold enough held-out rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.stages.prepare import PROMPT_SCHEMA

    rows = [
        {"id": f"p{i:04d}", "shard": i // 500, "split": "heldout" if i % 50 == 0 else "train",
         "messages": [{"role": "user", "content": f"question {i} " + "x" * 200}], "source": "data/set.jsonl:1"}
        for i in range(2000)
    ]  # fmt: skip
    local = tmp_path / "ingest-prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA), local, row_group_size=500)
    store.upload_file("outputs/ingest-prompts.parquet", local)
    url = store.join("outputs/ingest-prompts.parquet")
    first = read_eval_prompts(url, limit=3, split="heldout")
    assert [p.id for p in first] == ["p0000", "p0050", "p0100"]
    assert len(read_eval_prompts(url, split="heldout")) == 40
