"""The campaign engine: Ray Tune trials driven by the Optuna study, screened, promoted, recorded."""
