"""Evaluation: lm-eval tasks, perplexity and KL divergence; `qad-pipeline stage baseline`.

`evaluate_model` scores any model object (BF16, fake-quantized PTQ, QAD student) the same way:

* every task in `eval.tasks` through lm-eval's harness (`simple_evaluate`). A name with a YAML
  file in `eval.task_dir` is one of the project's tasks, read from the held-out jsonl that the
  calibration stage wrote; any other name is looked up in lm-eval's own task registry.
  The task's first listed metric is its score.
* perplexity over the held-out token windows (a task whose lower value is better);
* KL divergence to the BF16 model's next-token distribution, when reference log-probs are given.

The BF16 baseline stage (`run_baseline`) writes `metrics/baseline.json`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from qad_pipeline.artifacts import write_json
from qad_pipeline.config import ConfigError, EvalParams, Params, resolve
from qad_pipeline.tasks.calibration import load_ppl_windows

def project_task_config(name: str, task_dir: Path, eval_dir: Path) -> dict | None:
    """The project's task YAML, pointed at the held-out jsonl of this run; None if not ours."""
    path = task_dir / f"{name}.yaml"
    if not path.is_file():
        return None
    cfg = yaml.safe_load(path.read_text())
    data_file = eval_dir / f"{name}.jsonl"
    if not data_file.is_file():
        raise ConfigError(f"eval task {name!r} needs {data_file}; run the calibration stage first")
    cfg["dataset_kwargs"] = {"data_files": {cfg.get("test_split", "test"): str(data_file)}}
    return cfg


def check_tasks(params: EvalParams) -> None:
    """Every task name is a project task or known to lm-eval (checked before any model loads)."""
    task_dir = resolve(params.task_dir)
    foreign = [t for t in params.tasks if not (task_dir / f"{t}.yaml").is_file()]
    if not foreign:
        return
    from lm_eval.tasks import TaskManager

    known = set(TaskManager().all_tasks)
    unknown = [t for t in foreign if t not in known]
    if unknown:
        ours = sorted(p.stem for p in task_dir.glob("*.yaml"))
        raise ConfigError(f"unknown eval task(s) {unknown}: not in {task_dir} ({ours}) nor in lm-eval's registry")


def primary_score(task: str, results: dict, higher: dict, metric_order: list[str]) -> dict:
    """{"metric", "value", "higher_is_better", "all"} for one task of lm-eval's results."""
    values = {
        k.split(",")[0]: v
        for k, v in results.items()
        if "," in k and "_stderr" not in k and isinstance(v, (int, float))
    }
    if not values:
        raise RuntimeError(f"lm-eval returned no numeric metric for task {task!r}: {results}")
    metric = next((m for m in metric_order if m in values), next(iter(values)))
    return {
        "metric": metric,
        "value": float(values[metric]),
        "higher_is_better": bool(higher.get(metric, True)),
        "all": {k: float(v) for k, v in values.items()},
    }


def lm_eval_scores(model, tokenizer, params: EvalParams, eval_dir: Path) -> dict[str, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    task_dir = resolve(params.task_dir)
    specs, metric_orders = [], {}
    for name in params.tasks:
        cfg = project_task_config(name, task_dir, eval_dir)
        specs.append(cfg if cfg is not None else name)
        metric_orders[name] = [m["metric"] for m in (cfg or {}).get("metric_list", [])]
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=params.batch_size, device=device)
    out = simple_evaluate(
        model=lm, tasks=specs, limit=params.limit, log_samples=False, bootstrap_iters=0, verbosity="WARNING"
    )
    return {
        name: primary_score(name, out["results"][name], out["higher_is_better"].get(name, {}), metric_orders[name])
        for name in params.tasks
    }


@torch.no_grad()
def next_token_logprobs(model, windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Per batch, log-probabilities of the next token at every position (float32, on CPU)."""
    out = []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(next(model.parameters()).device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        out.append(F.log_softmax(logits, dim=-1).cpu())
    return out


def perplexity(logprobs: list[torch.Tensor], windows: torch.Tensor, batch_size: int) -> float:
    nll, count = 0.0, 0
    for i, lp in enumerate(logprobs):
        targets = windows[i * batch_size : i * batch_size + len(lp), 1:]
        nll -= lp.gather(-1, targets.unsqueeze(-1)).sum().item()
        count += targets.numel()
    return math.exp(nll / count)


def kl_divergence(reference: list[torch.Tensor], logprobs: list[torch.Tensor]) -> float:
    """Mean over positions of KL(reference || model), in nats."""
    total, count = 0.0, 0
    for ref, lp in zip(reference, logprobs, strict=True):
        total += (ref.exp() * (ref - lp)).sum().item()
        count += ref.shape[0] * ref.shape[1]
    return total / count


def evaluate_model(
    model, tokenizer, params: EvalParams, data_dir: Path, reference: list[torch.Tensor] | None = None
) -> dict:
    """Scores of one model: lm-eval tasks + perplexity (+ KL to the reference log-probs)."""
    windows = torch.from_numpy(load_ppl_windows(data_dir))
    logprobs = next_token_logprobs(model, windows, params.batch_size)
    tasks = lm_eval_scores(model, tokenizer, params, Path(data_dir) / "eval")
    tasks["perplexity"] = {
        "metric": "perplexity",
        "value": perplexity(logprobs, windows, params.batch_size),
        "higher_is_better": False,
    }
    result = {"tasks": tasks}
    if reference is not None:
        result["kl_divergence"] = kl_divergence(reference, logprobs)
    return result


def run_baseline(params: Params, data_dir: Path, metrics_path: Path) -> dict:
    """Stage core: score the BF16 base model; write metrics/baseline.json."""
    from qad_pipeline.modeling import checkpoint_identity, load_model, load_tokenizer
    from qad_pipeline.sizes import size_report

    model, tokenizer = load_model(params.base_model), load_tokenizer(params.base_model)
    scores = evaluate_model(model, tokenizer, params.eval, data_dir)
    sizes = size_report(model)
    metrics = {
        "model": checkpoint_identity(params.base_model),
        **scores,
        "effective_bpe": sizes["effective_bpe"],
        "size_bytes": sizes["size_bytes"],
        "status": "ok",
    }
    write_json(metrics_path, metrics)
    return metrics
