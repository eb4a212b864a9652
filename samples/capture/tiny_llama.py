"""A tiny Llama built from a config (random weights, nothing downloaded), run on a
left-padded batch of two prompts: what `sdpa capture` records in the README."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query: 2 K/V heads for 4 query heads
    max_position_embeddings=64,
    initializer_range=0.2,  # sharper attention than the default 0.02
    attn_implementation="eager",
)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 128, (2, 12))
mask = torch.ones(2, 12, dtype=torch.long)
mask[1, :4] = 0  # the second prompt is 4 tokens shorter: left padding
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
print(f"logits {tuple(logits.shape)}")
