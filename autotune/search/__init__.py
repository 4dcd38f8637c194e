"""Search: Optuna over a space, with the rules and every outcome as feedback; screening decisions."""
