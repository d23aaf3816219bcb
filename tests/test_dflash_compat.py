"""The exported drafter in the DFlash authors' own package: it loads without missing or
unexpected weights and its speculative greedy output equals plain greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_pipeline.core import layout
from dflash_pipeline.demo import task
from dflash_pipeline.stages.export import export_drafter
from tests.support.dflash_reference import run_reference_loop
from tests.test_training import run_segment, settings

pytestmark = pytest.mark.timeout(2400)  # a hang guard (see pyproject.toml)


@pytest.fixture(scope="module")
def trained_drafter(demo_model, tmp_path_factory):
    from tests.support.train_data import write_tokenized_shard

    root = tmp_path_factory.mktemp("compat")
    tokenized = {"00000": str(write_tokenized_shard(demo_model, root / "t.parquet", 96, seed=3))}
    s = settings(steps_per_segment=160, checkpoint_every_steps=1000, batch_size=4, block_size=8,
                 num_anchors=32, learning_rate=3e-3, warmup_ratio=0.05, min_lr_ratio=0.1,
                 loss_decay_gamma=4, intermediate_size=256)
    run_segment(root, 0, s, demo_model, tokenized)
    out = root / "drafter"
    out.mkdir()
    export_drafter(str(root), str(root / layout.segment_manifest_key(0)),
                   str(out / "config.json"), str(out / "model.safetensors"), "float32")
    return out


def demo_prompts(demo_model, count=4):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    rng = random.Random(1234)
    prompts = []
    for _ in range(count):
        text = tokenizer.apply_chat_template(
            task.prompt_messages(task.sample_problem(rng)), tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def plain_greedy(demo_model, prompt: list[int], max_new_tokens: int, stop_id: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == stop_id:
                break
    return ids


def test_authors_package_loads_export_and_decodes_losslessly(trained_drafter, demo_model):
    prompts = demo_prompts(demo_model)
    report = run_reference_loop(demo_model, trained_drafter, prompts, 96, ["<|im_end|>"])
    assert report["transformers"] == "5.15.0"
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == []
    assert report["block_size"] == 8 and report["mask_token_id"] == 3
    assert report["target_layer_ids"] == [1, 5]
    stop_id = 2  # <|im_end|> of the demo tokenizer
    accepted = []
    for prompt, result in zip(prompts, report["results"]):
        assert result["output_ids"] == plain_greedy(demo_model, prompt, 96, stop_id)
        accepted += result["acceptance_lengths"]
    # A trained drafter, run by someone else's loop, gets whole blocks accepted.
    assert sum(accepted) / len(accepted) >= 2.0, accepted


def test_authors_loop_reports_the_same_acceptance_lengths_as_this_stage(trained_drafter, demo_model):
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.evaluation.loop import DecodeSettings, speculative_decode
    from dflash_pipeline.evaluation.runner import TargetRunner
    from dflash_pipeline.model.inference import load_proposer

    prompts = demo_prompts(demo_model, count=3)
    report = run_reference_loop(demo_model, trained_drafter, prompts, 96, ["<|im_end|>"])
    target = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    proposer = load_proposer(trained_drafter, target)
    runner = TargetRunner(target, proposer.target_layer_ids)
    settings = DecodeSettings(max_new_tokens=96, stop_token_ids=frozenset({2}))
    for prompt, theirs in zip(prompts, report["results"]):
        trace = speculative_decode(runner, proposer, prompt, settings)
        assert prompt + trace.tokens == theirs["output_ids"]
        ours = [a + 1 for a in trace.accepted_lengths]  # tokens committed per verify step
        # Their last step counts only up to the stop token; every other step must agree.
        assert ours[:-1] == theirs["acceptance_lengths"][:-1]
        assert len(ours) == len(theirs["acceptance_lengths"])
