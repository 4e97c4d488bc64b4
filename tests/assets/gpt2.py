"""A tiny transformers GPT-2, built from a config (no download), shapes only."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, use_cache=False))


def example_inputs():
    return (torch.randint(0, 256, (2, 32)),)
