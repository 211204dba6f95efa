"""The GPU check's harness (scripts/gpu_check.py): stages run one after another, each with its wall
time, peak GPU memory and pass/fail, within a time budget, and the summary at the end."""

from __future__ import annotations

import gc
import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Result:
    model: str
    stage: str
    status: str  # ok | FAIL | SKIPPED | n/a
    seconds: float = 0.0
    peak_gpu_mb: float | None = None
    note: str = ""


class Check:
    """Runs stages one after another: wall time, peak GPU memory, pass/fail, time budget."""

    def __init__(self, cuda: bool, budget_s: float):
        self.cuda, self.budget_s, self.started = cuda, budget_s, time.perf_counter()
        self.results: list[Result] = []
        self.current = "-"  # the stage running now, named when the time limit stops the run

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def record(self, result: Result) -> Result:
        self.results.append(result)
        peak = f"{result.peak_gpu_mb:9.0f} MB" if result.peak_gpu_mb is not None else f"{'-':>12}"
        print(f"=== [{self.elapsed():6.1f} s] {result.model:<6} {result.stage:<38} {result.status:<7} "
              f"{result.seconds:7.1f} s  peak GPU {peak}  {result.note}", flush=True)
        return result

    def skip(self, model: str, stage: str, why: str) -> None:
        self.record(Result(model, stage, "SKIPPED", note=why))

    def run(self, model: str, stage: str, fn, *needs: bool):
        """Run `fn()` -> (value, note); None when it failed or was skipped."""
        if not all(needs):
            self.skip(model, stage, "an earlier stage it needs failed")
            return None
        if self.elapsed() > self.budget_s:
            self.skip(model, stage, f"time budget of {self.budget_s:.0f} s spent")
            return None
        print(f"--> {model} {stage} ...", flush=True)
        self.current = f"{model} {stage}"
        import torch

        gc.collect()
        if self.cuda and torch.cuda.is_available():
            torch.cuda.init()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            value, note = fn()
            status = "ok"
        except Exception as err:  # noqa: BLE001  (every failure is reported, the next stage goes on)
            traceback.print_exc()
            value, note, status = None, f"{type(err).__name__}: {err}".splitlines()[0][:300], "FAIL"
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**20 if self.cuda and torch.cuda.is_available() else None
        self.record(Result(model, stage, status, seconds, peak, note))
        return value if status == "ok" else None

    def summary(self, path: Path) -> int:
        failed = [r for r in self.results if r.status in ("FAIL", "SKIPPED")]
        print("\n================ GPU check summary ================")
        for r in self.results:
            peak = f"{r.peak_gpu_mb:8.0f}" if r.peak_gpu_mb is not None else f"{'-':>8}"
            print(f"{r.model:<6} {r.stage:<38} {r.status:<7} {r.seconds:7.1f} s {peak} MB  {r.note}")
        print(f"total {self.elapsed():.1f} s; {len(failed)} stage(s) failed or skipped"
              + (": " + ", ".join(f"{r.model} {r.stage}" for r in failed) if failed else ""))
        path.write_text(json.dumps({"seconds": self.elapsed(), "results": [asdict(r) for r in self.results]}, indent=2))
        print(f"summary written to {path}")
        return 1 if failed else 0
