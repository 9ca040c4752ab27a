"""The model zoo: seeded configs, and a GPU-sized model built on the device it will run on."""

import torch

from flexpage import zoo


def test_weights_are_seeded_and_built_where_asked():
    a, b, c = zoo.build("llama-tiny"), zoo.build("llama-tiny"), zoo.build("llama-tiny", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    big = zoo.build("llama-1b", dtype=torch.bfloat16, device="meta")  # shapes only: no memory
    assert {p.device.type for p in big.parameters()} == {"meta"} and big.dtype == torch.bfloat16
    assert 1.0e9 < sum(p.numel() for p in big.parameters()) < 1.2e9
    config = big.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (16, 2048, 32, 8, 8192, 32000)
    assert zoo.load_tokenizer("llama-1b").vocab_size == 32000
