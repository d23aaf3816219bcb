"""The MTP test target (``dflash_pipeline.demo.mtp_target``): a tiny MiMo-layout checkpoint (a
Qwen2 body and one MTP layer) that SGLang (NEXTN) and vLLM (method mtp) serve with the target's
own MTP head, so that `tune`'s MTP setting runs for real.

- The checkpoint holds exactly the tensors the engines' MiMo loaders read, with their shapes
  (the names as the loaders spell them: SGLang 0.5.17 and vLLM 0.26/0.32 ``models/mimo.py`` and
  ``models/mimo_mtp.py``), and tune plans its MTP setting for both engines.
- transformers loads its body (a Qwen2), whose greedy decoding follows the planted bigram.
- Each engine, in its own environment, builds the target and its MTP draft model from the folder
  as its server does with MTP on and loads every parameter of both from the checkpoint
  (tests/support/mtp_target_load.py); the checkpoint's names are exactly those parameters'.
- vLLM's CPU build serves it with the MTP command line tune launches, and accepts the MTP head's
  drafts (greedy: vLLM 0.32's CPU build cannot sample non-greedily with speculative decoding).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import httpx
import pytest
from safetensors import safe_open

from dflash_pipeline.demo.mtp_target import build_mtp_target
from dflash_pipeline.engines.tuning import has_mtp_head, mtp_speculative, variants
from tests.support.engine_envs import REPO, VLLM_CPU_ENV, VLLM_CPU_MEM_FRACTION, vllm_python

LOADER = REPO / "tests" / "support" / "mtp_target_load.py"
SGLANG_VERSION = "0.5.17"
TUNE = {"mtp": True, "mtp_steps": 3}

# One Qwen2 decoder layer's tensors (biased q/k/v), as both engines' Qwen2 loaders read them.
DECODER = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip
# An MTP layer's own tensors beside its decoder layer (the names both MiMo MTP loaders single out).
MTP_OWN = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_mtp_target(tmp_path_factory.mktemp("mtp") / "mtp-target")


@pytest.fixture(scope="module")
def config(target) -> dict:
    return json.loads((target / "config.json").read_text())


def checkpoint_shapes(target) -> dict[str, tuple[int, ...]]:
    with safe_open(str(target / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())  # a safe_open handle is not iterable
        return {name: tuple(weights.get_slice(name).get_shape()) for name in names}


def test_the_config_names_the_mimo_architecture_and_one_mtp_layer(config):
    # Both engines pick the MiMo classes by architectures[0]: SGLang's draft config becomes
    # MiMoMTP (configs/model_config.py), vLLM's MiMoMTPModel (config/speculative.py).
    assert config["architectures"] == ["MiMoForCausalLM"]
    # A model type transformers knows: no remote code for the engines' config loading.
    assert config["model_type"] == "qwen2"
    assert config["num_nextn_predict_layers"] == 1 and not config["tie_word_embeddings"]
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]


def test_the_checkpoint_holds_exactly_the_tensors_the_mimo_loaders_read(target, config):
    hidden, vocab, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    layer = {
        "self_attn.q_proj.weight": (q, hidden), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, hidden), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
    }  # fmt: skip
    assert set(layer) == set(DECODER)
    own = {"token_layernorm.weight": (hidden,), "hidden_layernorm.weight": (hidden,)}
    own |= {"input_proj.weight": (hidden, 2 * hidden), "final_layernorm.weight": (hidden,)}
    assert set(own) == set(MTP_OWN)
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    expected["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    # MTP layers are numbered from 0 under model.mtp_layers (both loaders' prefix pattern).
    expected |= {f"model.mtp_layers.0.{name}": shape for name, shape in {**layer, **own}.items()}
    assert checkpoint_shapes(target) == expected


def test_a_rebuild_from_a_built_targets_tokenizer_is_the_same_checkpoint(target, tmp_path):
    from safetensors.torch import load_file

    from transformers import AutoTokenizer

    again = build_mtp_target(tmp_path / "again", tokenizer_from=target)
    for name in ("config.json", "generation_config.json", "chat_template.jinja"):
        assert (again / name).read_text() == (target / name).read_text(), name
    # (transformers reads a qwen2 model's tokenizer as Qwen2Tokenizer, which writes an NFC
    # normalizer into tokenizer.json: the same ids for the demo's texts.)
    old, new = AutoTokenizer.from_pretrained(str(target)), AutoTokenizer.from_pretrained(str(again))
    assert old.get_vocab() == new.get_vocab() and new.model_max_length == 4096
    text = old.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False)
    assert old(text)["input_ids"] == new(text)["input_ids"]
    first, second = load_file(str(target / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


def test_tune_measures_mtp_on_it_with_both_engines_only(target):
    assert has_mtp_head(str(target))
    for engine in ("sglang", "vllm"):
        measured, line = variants(engine, str(target), TUNE, {})
        assert [v.mtp for v in measured] == [False, True] and line == "measured with and without MTP"
        assert measured[1].speculative["algorithm"] == "NEXTN"
    measured, line = variants("transformers", str(target), TUNE, {})
    assert [v.mtp for v in measured] == [False] and "does not serve" in line


def test_transformers_loads_its_body_whose_greedy_decoding_follows_the_planted_bigram(target, config):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=24)[0].tolist()[ids.shape[1] - 1 :]
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        # The bigram: the next token is the one whose lm_head row the current embedding matches.
        following = (embed @ head.T).argmax(dim=-1).tolist()
    assert all(following[a] == b for a, b in zip(out, out[1:])), out
    assert not set(out[1:]) & set(tokenizer.all_special_ids)  # no special token: runs to the limit


def unstacked(name: str) -> list[str]:
    """The checkpoint names an engine parameter is loaded from (fused q/k/v and gate/up split)."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return [name.replace(fused, part) for part in parts]
    return [name]


def engine_loads(command: list[str], env: dict, engine: str) -> dict:
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"{engine} could not build or load the MTP target (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_builds_the_target_and_its_mtp_draft_and_loads_every_parameter(target, config):
    python = vllm_python()
    env = {**os.environ, **VLLM_CPU_ENV, "HF_HUB_OFFLINE": "1"}
    loaded = engine_loads([str(python), str(LOADER), "vllm", str(target)], env, "vLLM")
    assert (loaded["target"]["class"], loaded["draft"]["class"]) == ("MiMoForCausalLM", "MiMoMTP")
    assert loaded["draft"]["architectures"] == ["MiMoMTPModel"]
    for role in ("target", "draft"):
        assert loaded[role]["unwritten"] == [], (role, loaded[role]["unwritten"])
    # The draft's MTP layers sit after the body's layers, each decoder layer in an mtp_block.
    start = config["num_hidden_layers"]
    draft = set()
    for name in loaded["draft"]["params"]:
        name = name.replace(f"model.mtp_layers.{start}.", "model.mtp_layers.0.").replace(".mtp_block.", ".")
        draft.update(unstacked(name))
    body = {n for name in loaded["target"]["params"] for n in unstacked(name)}
    assert body | draft == set(checkpoint_shapes(target))
    assert {n for n in draft if "mtp_layers" not in n} == {"model.embed_tokens.weight", "lm_head.weight"}


def test_sglang_builds_the_target_and_its_mtp_draft_and_loads_every_parameter(target):
    from tests.test_sglang_args import TORCHVISION_STUB, parser_env

    python = vllm_python()  # the SGLang parser environment links .venv-vllm's CPU torch
    folder = parser_env(SGLANG_VERSION)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=f"{folder}{os.pathsep}{TORCHVISION_STUB}", HF_HUB_OFFLINE="1")
    loaded = engine_loads([str(python), "-S", str(LOADER), "sglang", str(target)], env, f"SGLang {SGLANG_VERSION}")
    # NEXTN is EAGLE's alias; the MiMo draft's path stays unset and falls back to the target's.
    assert loaded["resolved_algorithm"] == "EAGLE" and loaded["draft_model_path"] is None
    assert (loaded["target"]["class"], loaded["draft"]["class"]) == ("MiMoForCausalLM", "MiMoMTP")
    for role in ("target", "draft"):
        assert loaded[role]["unwritten"] == [], (role, loaded[role]["unwritten"])
    # SGLang's draft holds one MTP layer: its own tensors on the model, its decoder layer in mtp_block.
    draft = set()
    for name in loaded["draft"]["params"]:
        name = name.replace("model.mtp_block.", "model.mtp_layers.0.")
        name = re.sub(rf"^model\.({'|'.join(n.split('.')[0] for n in MTP_OWN)})\.", r"model.mtp_layers.0.\1.", name)
        draft.update(unstacked(name))
    body = {n for name in loaded["target"]["params"] for n in unstacked(name)}
    assert body | draft == set(checkpoint_shapes(target))


@pytest.mark.workflow
@pytest.mark.xdist_group("vllm_taps")  # a lane of vLLM CPU servers (tests/conftest.py XDIST_GROUPS)
def test_vllm_cpu_serves_it_with_tunes_mtp_command_and_accepts_the_heads_drafts(target, tmp_path):
    from dflash_pipeline.engines.environments import engine_env
    from dflash_pipeline.engines.launch import ManagedServer, ServerSpec, free_port, server_command
    from dflash_pipeline.evaluation.engine_counters import parse_vllm_metrics
    from tests.test_generate_workflow import SLOW

    engines = {"vllm": {"python": str(vllm_python()), "env": dict(VLLM_CPU_ENV)}}
    # Two drafted tokens per step from the one MTP layer (tune's default is three).
    spec = ServerSpec(
        "vllm", str(target), free_port(), mem_fraction=VLLM_CPU_MEM_FRACTION, speculative=mtp_speculative(2),
        python=engines["vllm"]["python"], env=engine_env("vllm", engines),
    )  # fmt: skip
    command = server_command(spec)
    assert json.loads(command[command.index("--speculative-config") + 1]) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    with ManagedServer(spec, tmp_path / "vllm-mtp.log", tmp_path, startup_timeout=SLOW) as server:
        request = {
            "model": str(target),
            "messages": [{"role": "user", "content": "What is 12 + 30?"}],
            "max_tokens": 48,
            "temperature": 0,
        }
        reply = httpx.post(f"{server.spec.url}/v1/chat/completions", json=request, timeout=SLOW).json()
        metrics = httpx.get(f"{server.spec.url}/metrics", timeout=30).text
    assert reply["choices"][0]["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == 48
    counters = parse_vllm_metrics(metrics)
    assert counters.drafts > 0 and counters.draft_tokens == 2 * counters.drafts
    # The planted bigram: the head drafts what the target says (a misloaded head: about none).
    assert counters.accepted >= 0.9 * counters.draft_tokens, counters
    assert set(counters.accepted_per_pos) == {0, 1}


# tune's lines (stages/tune.py, engines/launch.py) of a run whose MTP server did not start.
TUNE_LOG_MTP_REFUSED = """\
2026-12-06 10:00:00,000 INFO tune: 16 prompts, 0.26.0, concurrencies [1, 8]; measured with and without MTP
2026-12-06 10:00:00,001 INFO starting vllm server: /e/bin/python -m vllm.entrypoints.openai.api_server --model /m (log: e.log)
2026-12-06 10:01:00,000 INFO vllm server healthy at http://127.0.0.1:30000
2026-12-06 10:02:00,000 INFO plain, concurrency 1: 812.5 output tokens/s, p50 TTFT 0.01 s, p50 TPOT 1.2 ms, 0 cut at the budget
2026-12-06 10:03:00,000 INFO plain, concurrency 8: 5210.0 output tokens/s, p50 TTFT 0.02 s, p50 TPOT 1.5 ms, 0 cut at the budget
2026-12-06 10:03:01,000 INFO vllm server stopped
2026-12-06 10:03:02,000 INFO starting vllm server: /e/bin/python -m vllm.entrypoints.openai.api_server --model /m \
--speculative-config {"method": "mtp", "num_speculative_tokens": 3} (log: e.log)
2026-12-06 10:03:30,000 ERROR vllm server exited with code 1 while starting; see its log e.log. Last lines:
"""


def test_the_gpu_checks_mtp_part_tells_a_refused_mtp_server_from_a_measured_one(monkeypatch):
    from types import SimpleNamespace

    from dflash_pipeline.demo.mtp_tune import summarize

    refused = summarize(None, TUNE_LOG_MTP_REFUSED)
    assert refused["plain_started"] and not refused["mtp_started"] and not refused["mtp_measured"]
    assert refused["plain_tokens_per_s"] == {"1": 812.5, "8": 5210.0} and refused["mtp_to_plain"] == {}

    settings = [{"mtp": mtp, "concurrency": c, "output_tokens_per_s": rate} for mtp, c, rate in
                [(False, 1, 800.0), (False, 8, 5000.0), (True, 1, 1600.0), (True, 8, 7500.0)]]  # fmt: skip
    result = {"settings": settings, "mtp": "measured with and without MTP", "choice": {"mtp": True}}
    result |= {"engine_version": "0.26.0", "device": "1 x NVIDIA H100"}
    log = TUNE_LOG_MTP_REFUSED.replace("ERROR vllm server exited", "INFO vllm server healthy at http://x ")
    measured = summarize(result, log)
    assert measured["plain_started"] and measured["mtp_started"] and measured["mtp_measured"]
    assert measured["mtp_to_plain"] == {"1": 2.0, "8": 1.5} and measured["choice"] == {"mtp": True}

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_check

    args = SimpleNamespace(no_cuda_tests=True)
    for summary, passed in ((refused | {"exit_code": 1}, False), (measured | {"exit_code": 0}, True)):
        record = {"engines": {"vllm": {"drafters": {}, "mtp_tune": summary}}}
        assert gpu_check.passed(record, args) is passed
