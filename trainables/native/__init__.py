"""The native PyTorch MoE VLM trainable (CPU and CUDA)."""
