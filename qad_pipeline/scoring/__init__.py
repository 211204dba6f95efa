"""Evaluation, recovery and racing: lm-eval's tasks and calls, the BF16 reference distribution, recovery arithmetic, racing the recipes, the served eval's scores."""
