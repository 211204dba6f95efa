"""The export's checks: the lint, the weights and reload checks, the serving check in vLLM (its environment, the student's reference, the verdict), verify-export and the failure catalog."""
