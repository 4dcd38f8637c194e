"""The leaf both sides import: the knob registry, model presets, the burst contract (requests,
step records, outcomes, the measurement contract), steady-state estimation, the recorded-table
format, the error tree and the trainable registry. It imports nothing else of ``autotune`` or
``trainables``, and none of torch, Ray, Optuna or Megatron."""
