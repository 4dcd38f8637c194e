"""The megatron-core MoE VLM trainable (CUDA only; builds and validates configs on the CPU)."""
