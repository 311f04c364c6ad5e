"""DLRM training on Criteo-Kaggle with low-precision cached embedding tables (see SPEC.md section 7)."""
