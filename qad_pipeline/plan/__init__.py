"""The plan: each stage's memory, time, GPUs and disk, target nodes and work pools, and the preflight that reads every input before a stage starts."""
