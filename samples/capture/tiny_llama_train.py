"""One training step of a tiny Llama built from a config (random weights, nothing
downloaded): forward, the loss, backward. What `sdpa capture --backward` records in
docs/reference/capture.md: each attention call's dO and its dQ, dK, dV."""

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
    initializer_range=0.1,
    attn_implementation="eager",
)
model = LlamaForCausalLM(config).train()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ids = torch.randint(0, 128, (2, 16))
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
optimizer.step()
print(f"loss {loss.item():.3f}")
