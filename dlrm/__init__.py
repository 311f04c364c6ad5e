"""DLRM training on Criteo-Kaggle with low-precision cached embedding tables (see docs/contract.md §7)."""
