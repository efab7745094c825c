"""Tensor building blocks: weight formats, rotary embedding, paged attention, sampler."""
