"""Benchmarks and demos built on flexpage and the model zoo (``flexpage-bench`` runs them)."""
