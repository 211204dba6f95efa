"""Layerwise PTQ: Model Optimizer's own layer-by-layer calibration, with resumable per-layer checkpoints.

`ptq.layerwise` (true | false | auto) decides per recipe (`enabled`). When on, the recipe's
algorithm gets Model Optimizer's `layerwise: {enable: true, checkpoint_dir: ...}` (`with_layerwise`):
`mtq.quantize` then calibrates one decoder layer at a time (each layer's inputs captured by a
forward that stops at it, the layers before it replaced by stand-ins), saves each finished layer
(its quantizer state and weights, and the next layer's inputs) and, run again on the same folder,
resumes after the last finished layer (`resume_point`, Model Optimizer's `detect_resume_point`).

What this module adds to Model Optimizer's:

* **Where the checkpoints live and whom they belong to.** `<out-root>/artifacts/ptq_layerwise/<recipe>/<key>/`,
  outside the recipe's artifact folder (the stage clears that before it runs). Model Optimizer
  only checks that a checkpoint has the same number of layers; `checkpoint_key` hashes what decides
  the calibration (recipe file, calibration samples, base model, batch size, Model Optimizer's
  version), and `checkpoint_dir` removes a folder under any other key, so a changed recipe or
  calibration starts afresh instead of resuming someone else's layers. The PTQ stage removes the
  folder once the recipe's outputs are written.
* **The quantizers outside the decoder layers.** Model Optimizer 0.47 calibrates only the
  quantizers inside decoder layers: `lm_head`'s weight quantizer (NVFP4 W4A16 in every shipped
  recipe) is left uncalibrated (a dynamic global scale with `max`; a crash in the first forward
  with the static NVFP4 weights of `mse`/four-over-six). `calibrate_outside_layers` runs the
  recipe's own algorithm, through Model Optimizer's calibration-mode entry point, on those
  modules' weights (GPTQ as its first step, max scales, and the local-Hessian search as plain MSE:
  both need the layer's inputs, `weight_only`). An input quantizer there would need activations no
  layer-by-layer pass produces: such a recipe is refused before any layer is calibrated
  (`check_outside_layers`).
  (Fixed upstream in NVIDIA/Model-Optimizer#2339, after 0.47.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qad_pipeline.core.artifacts import fingerprint
from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.core.modeling import model_location

ROOT_NOTE = "per-layer checkpoints of Model Optimizer's layerwise calibration"


def decoder_layers(model):
    """The decoder layers Model Optimizer calibrates one by one (None: it finds none in this model)."""
    from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

    return LayerActivationCollector.get_decoder_layers(model)


def offloaded(model) -> bool:
    """accelerate put some of the weights on the host or disk: the model does not fit the GPUs this
    process got (the memory plan's `host:offloaded` term, measured instead of estimated)."""
    placement = getattr(model, "hf_device_map", None) or {}
    return any(str(where) in ("cpu", "disk") for where in placement.values())


def enabled(setting: bool | str, model, recipe: str, auto_quantize: bool) -> bool:
    """Whether `recipe` calibrates layer by layer: `true` always (refused where it cannot), `false`
    never, `auto` when accelerate offloaded part of the model (device_map auto on GPUs too small for
    it) and Model Optimizer finds the decoder layers. On a CPU, auto is whole-model."""
    if setting is False:
        return False
    if auto_quantize:
        if setting is True:
            raise ConfigError(f"ptq.layerwise: recipe {recipe} is an AutoQuantize recipe, whose search has no "
                              "layerwise mode in Model Optimizer; set ptq.layerwise to auto or false")
        return False
    found = decoder_layers(model) is not None
    if setting is True and not found:
        raise ConfigError(f"ptq.layerwise: Model Optimizer finds no decoder layers to calibrate one by one in "
                          f"{type(model).__name__}; set ptq.layerwise to auto or false")
    return found and (setting is True or offloaded(model))


def checkpoint_key(params: Params, recipe_path: Path, data_dir: Path) -> str:
    """What the per-layer checkpoints depend on, hashed: the recipe file, the calibration samples (their
    manifest), the base model (path, revision, dtype; a local folder's file names, sizes and times),
    the calibration batch size (the captured inputs are per batch) and Model Optimizer's version."""
    import modelopt

    base = params.base_model
    folder = Path(model_location(base))
    files = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(folder.iterdir())
             if f.is_file()] if folder.is_dir() else []
    return fingerprint([recipe_path.read_bytes(), (data_dir / "manifest.json").read_bytes(),
                        json.dumps(base.model_dump(), sort_keys=True), *files,
                        str(params.ptq.calib_batch_size), modelopt.__version__])[:16]


def checkpoint_dir(root: Path, key: str) -> Path:
    """`root/<key>`, with the folders of any other key under `root` removed (stale: another recipe
    file, other calibration samples); the folder itself is kept, to resume from."""
    if root.is_dir():
        for other in root.iterdir():
            if other.name != key:
                shutil.rmtree(other) if other.is_dir() else other.unlink()
    return root / key


def resume_point(folder: Path) -> int:
    """The layer Model Optimizer will resume from in `folder` (0: from the start), read as it reads it."""
    from modelopt.torch.quantization.utils.layerwise_calib import detect_resume_point

    found = detect_resume_point(str(folder)) if folder.is_dir() else None
    return found[0] if found else 0


def plain_algorithm(config: dict) -> dict:
    """The recipe's algorithm as a dict (`max` -> `{"method": "max"}`), without any layerwise setting."""
    algorithm = config.get("algorithm")
    algorithm = {"method": algorithm} if algorithm is None or isinstance(algorithm, str) else dict(algorithm)
    algorithm.pop("layerwise", None)
    return algorithm


def with_layerwise(config: dict, folder: Path | None) -> dict:
    """`config` with Model Optimizer's layerwise calibration on, checkpointing every layer into `folder`
    (None: no checkpoints)."""
    setting = {"enable": True, **({"checkpoint_dir": str(folder)} if folder is not None else {})}
    return {**config, "algorithm": {**plain_algorithm(config), "layerwise": setting}}


def _outside(model) -> list[tuple[str, object]]:
    """(name, module) of the modules with an enabled quantizer outside the decoder layers."""
    from modelopt.torch.quantization.nn import QuantModule, TensorQuantizer

    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers) + "."
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, QuantModule) and not name.startswith(prefix)
            and any(isinstance(q, TensorQuantizer) and q.is_enabled for q in module.children())]


def check_outside_layers(model, recipe: str) -> None:
    """Refuse, before any layer is calibrated, a recipe that quantizes activations outside the decoder
    layers (layerwise calibration calibrates nothing there; weights are calibrated afterwards)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    for name, module in _outside(model):
        weights = {id(q) for _, q in module.iter_weights_for_calibration()}
        inputs = [f"{name}.{n}" for n, q in module.named_children()
                  if isinstance(q, TensorQuantizer) and q.is_enabled and id(q) not in weights]
        if inputs:
            raise ConfigError(f"ptq.layerwise: recipe {recipe} quantizes {inputs[0]}, outside the decoder layers, "
                              "which Model Optimizer's layerwise calibration does not calibrate; "
                              "set ptq.layerwise to false for it")


def weight_only(algorithm: dict) -> dict:
    """The recipe's `algorithm` as it can run on weights alone: GPTQ's Hessian and the local-Hessian
    metric need the layer's inputs, which no forward brings outside the decoder layers, so there
    GPTQ keeps its own first step (max block scales) and the local-Hessian search becomes the plain
    MSE search it weights (same candidates); every other algorithm is unchanged."""
    method = algorithm.get("method")
    if method == "gptq":
        return {"method": "max"}
    if method == "local_hessian":
        return {"method": "mse", **{k: v for k, v in algorithm.items()
                                    if k in ("step_size", "start_multiplier", "stop_multiplier", "fp8_scale_sweep")}}
    return algorithm


def calibrate_outside_layers(model, algorithm: dict) -> list[str]:
    """Calibrate the weight quantizers outside the decoder layers with the recipe's `algorithm` (as
    `weight_only` runs it), through Model Optimizer's calibration-mode entry point (what
    `mtq.calibrate` applies), weight-only (no forward pass: `check_outside_layers` made sure no
    activation is quantized there). Returns their names."""
    from modelopt.torch.quantization.mode import CalibrateModeRegistry, get_modelike_from_algo_cfg

    [(mode, settings)] = get_modelike_from_algo_cfg(weight_only(algorithm))
    descriptor = CalibrateModeRegistry[mode]
    config = descriptor.config_class(**settings)
    names = []
    for name, module in _outside(model):
        descriptor.convert(module, config, forward_loop=None)
        names.append(name)
    return names
