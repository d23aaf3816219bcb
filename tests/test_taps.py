"""Target taps = outputs of the tapped decoder layers before the final norm (HF
hidden_states[id + 1] for every layer but the last, whose HF entry is final-normed), for a dense
Qwen3 and a hybrid Gated-DeltaNet (Qwen3.5-style) target; and the vLLM layer-id conventions."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.model.taps import TargetTaps, decoder_layers, vllm_aux_layer_ids, vllm_slot_order


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def tiny_hybrid():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    torch.manual_seed(0)
    # On the GPU where one is: with flash-linear-attention installed (the GPU environment),
    # transformers runs the Gated-DeltaNet layers through its Triton kernels, CUDA tensors only.
    return Qwen3_5ForCausalLM(config).eval().to("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("build,layer_ids", [(tiny_qwen3, [1, 2, 4]), (tiny_hybrid, [0, 2])])
def test_taps_are_hf_hidden_states_at_id_plus_one(build, layer_ids):
    model = build()
    input_ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1)).to(model.device)
    with torch.no_grad():
        reference = model(input_ids, output_hidden_states=True).hidden_states
    taps = TargetTaps(model, layer_ids)(input_ids)
    expected = torch.cat([reference[i + 1] for i in layer_ids], dim=-1)
    assert taps.shape == expected.shape
    torch.testing.assert_close(taps, expected, rtol=1e-5, atol=1e-5)
    # The offset matters: the layer's input (hidden_states[id]) is a different tensor.
    assert not torch.allclose(taps[..., :32], reference[layer_ids[0]])


def test_right_padding_does_not_change_a_sequence_taps():
    model = tiny_hybrid()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    ids = ids.to(model.device)
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long, device=model.device)], dim=1)
    taps = TargetTaps(model, [1, 3])
    torch.testing.assert_close(taps(padded)[:, :9], taps(ids), rtol=1e-5, atol=1e-5)


def decoder_layer_outputs(model, input_ids) -> list[torch.Tensor]:
    """Every decoder layer's output, caught by hooks on the layers themselves."""
    outputs = []

    def hook(module, args, output):
        outputs.append(output[0] if isinstance(output, tuple) else output)

    handles = [layer.register_forward_hook(hook) for layer in decoder_layers(model)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_hybrid])
def test_the_last_layers_tap_is_its_output_before_the_final_norm(build):
    model = build()
    last = model.config.num_hidden_layers - 1
    input_ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3)).to(model.device)
    outputs = decoder_layer_outputs(model, input_ids)
    taps = TargetTaps(model, [last, 0])(input_ids)
    torch.testing.assert_close(taps, torch.cat([outputs[last], outputs[0]], dim=-1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        hf_last = model(input_ids, output_hidden_states=True).hidden_states[last + 1]
    # transformers' last hidden state is the final-normed one: not a tap.
    torch.testing.assert_close(hf_last, model.model.norm(outputs[last]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(taps[..., :32], hf_last, atol=1e-2)


def test_the_evaluation_runner_taps_the_last_layer_before_the_final_norm():
    from dflash_pipeline.evaluation.runner import TargetRunner

    model = tiny_qwen3()
    last = model.config.num_hidden_layers - 1
    tokens = [3, 9, 14, 2, 7, 30, 41]
    runner = TargetRunner(model, [1, last])
    runner.start()
    logits, rows = runner.forward(tokens)
    outputs = decoder_layer_outputs(model, torch.tensor([tokens]))
    torch.testing.assert_close(rows, torch.cat([outputs[1][0], outputs[last][0]], dim=-1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(torch.tensor([tokens])).logits[0].float(), rtol=1e-5, atol=1e-5)


def test_vllm_aux_ids_are_one_above_the_taps_and_come_back_ascending():
    # Project tap k = transformers hidden_states[k + 1] = vLLM aux layer id k + 1.
    assert vllm_aux_layer_ids([5, 1, 7]) == [2, 6, 8]
    assert vllm_aux_layer_ids([3, 3]) == [4]
    # vLLM stores [2, 6, 8] in that order; taps asked as [5, 1, 7] are slots 1, 0, 2.
    assert vllm_slot_order([5, 1, 7]) == [1, 0, 2]
    assert vllm_slot_order([1, 5]) == [0, 1]
    assert vllm_slot_order([3, 3]) == [0, 0]
