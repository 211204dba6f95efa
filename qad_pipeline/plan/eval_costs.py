"""What each evaluation sends: lm-eval requests and tokens per stage, the perplexity/KL window
tokens, and racing's budget (`qad-pipeline plan`; `qad_pipeline.plan.costs.seconds` prices the tokens).

A full evaluation (the baseline, a PTQ recipe with racing off, a sweep point, the final eval) runs
every task of `eval.tasks` on its items (`eval.task_settings.<task>.limit`, else `eval.limit`, cuts
each task, or for a group each sub-task, as lm-eval's `limit` does) and `eval.ppl_samples` windows
of `eval.seq_len` tokens (perplexity and KL to the BF16 reference share that forward pass).

Requests are lm-eval's: one per choice of a multiple-choice item, one per generated answer.
Tokens are those the model runs through, under lm-eval's HF model: each request's context and
continuation, with the few-shot examples, and for a generation its generated tokens. MMLU's four
choices are the one-token letters A-D, whose requests lm-eval's HF model answers from one forward
pass (its `logits_cache`, on by default): one forward per item, four requests.

* The project's own tasks (`eval.task_dir`): heldout_cloze one request per item, heldout_continuation
  four (the true continuation and three swapped ones), each LM_EVAL_PROJECT_TOKENS.
* lm-eval's registry: the standard suite's facts below (`STANDARD`). Split, choices and the default
  few-shot count are lm-eval 0.4.13's task YAMLs (tests/test_eval_costs.py reads them); the item
  counts are the public sizes of those splits. The tokens per request are ESTIMATES, not counts:
  public mean prompt lengths in characters (evalscope's benchmark pages: MMLU 5-shot 3,212, GSM8K
  4-shot 1,967, ARC-Challenge 454, HellaSwag 768, Winogrande 307, IFEval 211), less their own
  instruction header, re-shaped to lm-eval's prompt and read at ~4 characters per token (Llama 3's
  tokenizer on English). Generated tokens: GSM8K stops at "Question:" after an answer of about a
  hundred tokens (150 counted, lm-eval's HF cap is 256); IFEval stops only at end-of-text, counted
  at its max_gen_toks of 1,280 (a base model without a chat template rarely stops sooner). A chat
  template's few tokens are not counted.
* Any other registry task is not counted (its size is not known offline): the plan names it.

Racing (`race.enabled`): a PTQ recipe scores round 1's items, `racing.slice_size(n, fractions[0])`
of each task's n (a group such as MMLU is one task of all its sub-tasks' items, as
`qad_pipeline/scoring/eval_groups.py` numbers them) and of the windows; a task without per-item values
(`raced=False`) is scored in full in round 1 and never again. The race stage scores the later
rounds of the recipes still in contention: at worst every recipe finishes (together the same as full evaluation), at best one goes
past round 1. The plan prices the race stage at its worst case.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from qad_pipeline.core.config import Params, resolve
from qad_pipeline.plan.memory_model import LM_EVAL_PROJECT_TOKENS
from qad_pipeline.scoring.racing import slice_size
from qad_pipeline.core.stages import stage_of

CONTINUATION_CHOICES = 4  # heldout_continuation: the true continuation and three swapped ones
HF_MAX_GEN_TOKS = 256  # lm-eval's HF model: tokens generated at most, unless the task or gen_kwargs say

MMLU_TEST = {  # items of each MMLU subject's test split (cais/mmlu): 14,042 in all
    "abstract_algebra": 100, "anatomy": 135, "astronomy": 152, "business_ethics": 100, "clinical_knowledge": 265,
    "college_biology": 144, "college_chemistry": 100, "college_computer_science": 100, "college_mathematics": 100,
    "college_medicine": 173, "college_physics": 102, "computer_security": 100, "conceptual_physics": 235,
    "econometrics": 114, "electrical_engineering": 145, "elementary_mathematics": 378, "formal_logic": 126,
    "global_facts": 100, "high_school_biology": 310, "high_school_chemistry": 203,
    "high_school_computer_science": 100, "high_school_european_history": 165, "high_school_geography": 198,
    "high_school_government_and_politics": 193, "high_school_macroeconomics": 390, "high_school_mathematics": 270,
    "high_school_microeconomics": 238, "high_school_physics": 151, "high_school_psychology": 545,
    "high_school_statistics": 216, "high_school_us_history": 204, "high_school_world_history": 237,
    "human_aging": 223, "human_sexuality": 131, "international_law": 121, "jurisprudence": 108,
    "logical_fallacies": 163, "machine_learning": 112, "management": 103, "marketing": 234, "medical_genetics": 100,
    "miscellaneous": 783, "moral_disputes": 346, "moral_scenarios": 895, "nutrition": 306, "philosophy": 311,
    "prehistory": 324, "professional_accounting": 282, "professional_law": 1534, "professional_medicine": 272,
    "professional_psychology": 612, "public_relations": 110, "security_studies": 245, "sociology": 201,
    "us_foreign_policy": 100, "virology": 166, "world_religions": 171,
}


@dataclass(frozen=True)
class KnownTask:
    """A registry task's size: facts from its lm-eval YAML and its dataset, and token estimates."""

    split: str  # the split lm-eval scores
    items: dict[str, int]  # items per (sub-)task: lm-eval's limit cuts each
    choices: int  # requests per item: its choices (multiple_choice), 1 (generate_until)
    fewshot: int  # lm-eval's default num_fewshot (none in the YAML: 0)
    request_tokens: int  # estimate: one zero-shot request, context + continuation
    shot_tokens: int  # estimate: one few-shot example, question and answer
    generated: int = 0  # estimate: tokens generated per item (generate_until)
    one_forward: bool = False  # one-token choices: lm-eval's HF model runs one forward per item
    raced: bool = True  # it has per-item values (a group: gathered from its sub-tasks); False: scored in full in round 1


STANDARD: dict[str, KnownTask] = {
    "mmlu": KnownTask("test", {f"mmlu_{s}": n for s, n in MMLU_TEST.items()}, 4, 0, 140, 125,
                      one_forward=True),
    "gsm8k": KnownTask("test", {"gsm8k": 1319}, 1, 5, 65, 155, generated=150),
    "arc_challenge": KnownTask("test", {"arc_challenge": 1172}, 4, 0, 50, 55),
    "hellaswag": KnownTask("validation", {"hellaswag": 10042}, 4, 0, 80, 80),
    "winogrande": KnownTask("validation", {"winogrande": 1267}, 2, 0, 28, 28),
    "ifeval": KnownTask("train", {"ifeval": 541}, 1, 0, 55, 0, generated=1280),
}


@dataclass
class TaskSize:
    """One task of a full evaluation: items, requests and tokens, and whether racing slices it."""

    task: str
    items: dict[str, int]  # per (sub-)task, after the limit
    requests: int
    tokens: int
    raced: bool = True

    def share(self, fraction: float | None) -> tuple[int, int, int]:
        """(items, requests, tokens) a round at `fraction` scores (None: every item)."""
        total = sum(self.items.values())
        if fraction is None or not self.raced:
            return total, self.requests, self.tokens
        n = slice_size(total, fraction)  # a group is sliced as one task (`racing.round_ids`)
        return n, self.requests * n // total, self.tokens * n // total


def _cut(n: int, params: Params, task: str) -> int:
    """A (sub-)task's `n` items under its limit: `eval.task_settings.<task>.limit`, else `eval.limit`."""
    limit = params.eval.settings(task).limit or params.eval.limit
    return n if limit is None else min(n, limit)


def task_sizes(params: Params) -> tuple[list[TaskSize], list[str]]:
    """Each task of `eval.tasks` at a full evaluation, and the tasks whose size is not known."""
    ev, ours = params.eval, resolve(params.eval.task_dir)
    sizes, unknown = [], []
    for task in ev.tasks:
        if (ours / f"{task}.yaml").is_file():
            per_item = {"heldout_cloze": 1, "heldout_continuation": CONTINUATION_CHOICES}.get(task)
            if per_item is None:
                unknown.append(task)
                continue
            n = _cut(ev.num_cloze if task == "heldout_cloze" else ev.num_continuation, params, task)
            sizes.append(TaskSize(task, {task: n}, n * per_item, n * per_item * LM_EVAL_PROJECT_TOKENS))
        elif task in STANDARD:
            known, settings = STANDARD[task], ev.settings(task)
            items = {name: _cut(n, params, task) for name, n in known.items.items()}
            n = sum(items.values())
            shots = known.fewshot if settings.num_fewshot is None else settings.num_fewshot
            cap = (settings.gen_kwargs or {}).get("max_gen_toks", known.generated)
            forwards = 1 if known.one_forward else known.choices
            tokens = n * (forwards * (known.request_tokens + shots * known.shot_tokens) + min(known.generated, cap))
            sizes.append(TaskSize(task, items, n * known.choices, tokens, known.raced))
        else:
            unknown.append(task)
    return sizes, unknown


def uncounted_tasks(params: Params) -> list[str]:
    """The eval tasks whose cost the plan leaves out (their size is not known offline)."""
    return task_sizes(params)[1]


@dataclass
class EvalCost:
    """What one stage process evaluates: lm-eval items, requests and tokens, and the perplexity/KL
    windows (one forward pass serves both) and their tokens."""

    items: int = 0
    requests: int = 0
    tokens: int = 0
    windows: int = 0
    window_tokens: int = 0
    note: str = ""
    best: EvalCost | None = None  # the race: when only one recipe goes past round 1
    uncounted: list[str] = field(default_factory=list)

    _SUMMED = ("items", "requests", "tokens", "windows", "window_tokens")

    @property
    def total_tokens(self) -> int:
        return self.tokens + self.window_tokens

    def _combine(self, other: EvalCost, sign: int) -> EvalCost:
        return EvalCost(*(getattr(self, k) + sign * getattr(other, k) for k in self._SUMMED), uncounted=self.uncounted)

    def __add__(self, other: EvalCost) -> EvalCost:
        return self._combine(other, 1)

    def __sub__(self, other: EvalCost) -> EvalCost:
        return self._combine(other, -1)

    def times(self, k: int) -> EvalCost:
        return EvalCost(*(getattr(self, key) * k for key in self._SUMMED), uncounted=self.uncounted)

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "best"}
        return {**out, "best": self.best.as_dict() if self.best else None}


def evaluation(params: Params, fraction: float | None = None) -> EvalCost:
    """One candidate's evaluation on the items a round at `fraction` scores (None: every item)."""
    sizes, unknown = task_sizes(params)
    ev = params.eval
    windows = ev.ppl_samples if fraction is None else slice_size(ev.ppl_samples, fraction)
    out = EvalCost(windows=windows, window_tokens=windows * ev.seq_len, uncounted=unknown)
    for size in sizes:
        items, requests, tokens = size.share(fraction)
        out.items, out.requests, out.tokens = out.items + items, out.requests + requests, out.tokens + tokens
    return out


def round_items(params: Params) -> list[int]:
    """Items one candidate has scored by the end of each of `race.fractions`' rounds, counted as the
    race counts them (`metrics/race.json`): lm-eval items of the raced tasks and perplexity windows,
    and a task it does not race in full."""
    rounds = [evaluation(params, f) for f in params.race.fractions]
    return [c.items + c.windows for c in rounds]


def stage_cost(stage: str, params: Params) -> EvalCost | None:
    """What one process of `stage` (`ptq/<recipe>`, `race`, ...) evaluates, by its `Stage.eval_cost`;
    None: it evaluates nothing. An unknown stage is an error."""
    declared, _ = stage_of(stage)
    return declared.load("eval_cost")(params) if declared.eval_cost else None


# -- the stages' evaluation costs: each `Stage.eval_cost` names one ---------------------------------


def full(params: Params) -> EvalCost:
    """A full evaluation: every task's items and every window."""
    return evaluation(params)


def first_round(params: Params) -> EvalCost:
    """A PTQ recipe: in full, or with racing round 1's items."""
    if not params.race.enabled:
        return evaluation(params)
    first = params.race.fractions[0]
    cost = evaluation(params, first)
    cost.note = f"round 1: {first:.0%} of each raced task's items"
    return cost


def served(params: Params) -> EvalCost:
    """eval.backend vllm: the BF16 model and the export, each in full, through vLLM."""
    cost = evaluation(params).times(2)
    cost.note = "the BF16 model and the export, through vLLM"
    return cost


def later_rounds(params: Params) -> EvalCost:
    """The race: the later rounds, of every recipe at worst, of one at best."""
    later = evaluation(params) - evaluation(params, params.race.fractions[0])
    cost = later.times(len(params.ptq.recipes))
    cost.note, cost.best = "worst case: every recipe finishes", later
    return cost


def count_text(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K" if n >= 1e4 else f"{n:,.0f}"


def summary(params: Params, rows: list[tuple[str, EvalCost, float | None]]) -> list[str]:
    """The plan's lines on evaluation: per evaluating stage (`rows`: stage, cost, estimated GPU-hours
    of its evaluation or None), the total, and racing's budget."""
    head = ("evaluation per stage process (lm-eval requests, tokens; perplexity/KL window tokens; registry "
            "tasks' tokens are estimates, qad_pipeline/plan/eval_costs.py):")
    lines = [head]
    width = max(len(s) for s, _, _ in rows) if rows else 0
    for stage, cost, hours in rows:
        gpu_h = f", ~{hours:,.2f} GPU-h" if hours is not None else ""
        note = f" ({cost.note})" if cost.note else ""
        lines.append(f"  {stage:<{width}}  {cost.requests:>9,} requests  {count_text(cost.tokens):>7} tokens  "
                     f"{count_text(cost.window_tokens):>6} window tokens{gpu_h}{note}")
    hours = [h for _, _, h in rows if h is not None]
    if rows:
        total = sum((c for _, c, _ in rows), EvalCost())
        lines.append(f"  {'total':<{width}}  {total.requests:>9,} requests  {count_text(total.tokens):>7} tokens  "
                     f"{count_text(total.window_tokens):>6} window tokens"
                     + (f", ~{sum(hours):,.1f} GPU-h (assumed MFU)" if len(hours) == len(rows) else ""))
    if params.race.enabled:
        per_round = round_items(params)
        full = per_round[-1]
        n = len(params.ptq.recipes)
        best = n * per_round[0] + full - per_round[0]
        lines.append(f"racing: items (lm-eval items + windows) per recipe by round {', '.join(f'{k:,}' for k in per_round)} "
                     f"(race.fractions {params.race.fractions}); {n} recipes: worst case {n * full:,} items "
                     f"(every recipe finishes: as full evaluation), best case {best:,} (one goes past round 1)")
    return lines
