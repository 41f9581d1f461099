"""The trainer's side of an RL loop, importable without a server: the catalog replay (the
behaviour policy's masked log-softmax from the trainer's own logits), the estimators for beams
sampled without replacement, and the shared-memory weight arena a push sends without a copy."""
