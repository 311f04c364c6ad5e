"""Criteo-Kaggle data: preprocessing (criteo), synthetic data (synthetic), batches (batches)."""
