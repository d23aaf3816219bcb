"""Target taps = outputs of the tapped decoder layers (HF hidden_states[id + 1]), for a dense
Qwen3 and a hybrid Gated-DeltaNet (Qwen3.5-style) target."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.model.taps import TargetTaps


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
    return Qwen3_5ForCausalLM(config).eval()


@pytest.mark.parametrize("build,layer_ids", [(tiny_qwen3, [1, 2, 4]), (tiny_hybrid, [0, 2])])
def test_taps_are_hf_hidden_states_at_id_plus_one(build, layer_ids):
    model = build()
    input_ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
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
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    taps = TargetTaps(model, [1, 3])
    torch.testing.assert_close(taps(padded)[:, :9], taps(ids), rtol=1e-5, atol=1e-5)
