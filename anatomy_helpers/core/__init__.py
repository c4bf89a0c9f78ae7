"""The foundations every other part builds on: the course GPT (model), its data, activation checkpointing,
argument checks, units and text tables."""
