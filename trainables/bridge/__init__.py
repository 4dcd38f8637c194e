"""Megatron-Bridge's side of the tuner: what a ``bridge`` trainable needs to run a user's recipe."""
