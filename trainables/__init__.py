"""The trainables: each runs one burst of a MoE VLM with one config and reports every step.

``native`` (plain PyTorch, CPU or CUDA), ``megatron`` (megatron-core, CUDA) and ``replay`` (a
recorded table, no device). They share the step loop and the end of a step (``steps.py``), the
measurement contract (``measurement.py``) and the local launcher (``launch.py``); of the tuner they
import only ``autotune.core``, never Optuna or Ray, and the tuner finds them by name in
``autotune/core/registry.py``.
"""
