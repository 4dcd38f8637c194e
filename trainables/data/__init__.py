"""Real image-text data: photo shards, Qwen-VL style image processing, byte tokens, packing."""
