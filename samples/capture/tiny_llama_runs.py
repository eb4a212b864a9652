"""A tiny Llama built from a config (random weights, nothing downloaded, 4 layers), run
on a left-padded batch with the attention implementation and dtype given: the runs
`sdpa diff` compares in the capture guide.

    python samples/capture/tiny_llama_runs.py eager float32
    python samples/capture/tiny_llama_runs.py sdpa bfloat16 [--rotary-bug LAYER]

--rotary-bug LAYER turns that layer's rotary embedding the wrong way (sin negated),
a bug upstream of attention: its Q and K are wrong, its V is not.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("attention", choices=["eager", "sdpa"])
parser.add_argument("dtype", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--rotary-bug", type=int, metavar="LAYER")
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query: 2 K/V heads for 4 query heads
    max_position_embeddings=64,
    initializer_range=0.1,
)
model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
model.set_attn_implementation(args.attention)


def rotary_turned_back(_module, positional, kwargs):
    cos, sin = kwargs["position_embeddings"]
    return positional, {**kwargs, "position_embeddings": (cos, -sin)}


if args.rotary_bug is not None:
    attention = model.model.layers[args.rotary_bug].self_attn
    attention.register_forward_pre_hook(rotary_turned_back, with_kwargs=True)

ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
mask[1, :5] = 0  # the second prompt is 5 tokens shorter: left padding
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
print(f"logits {tuple(logits.shape)}, {args.attention} attention in {args.dtype}")
