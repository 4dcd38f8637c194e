"""The replay trainable: recorded bursts served through the burst contract (autotune/tables.py)."""
