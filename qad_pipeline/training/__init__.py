"""QAD's training support: the distillation loss, the teacher's cached logits, QAD's training text, distributed training (torchrun, FSDP2) and Kubeflow training jobs."""
