"""The role of each projection in a model, read from its modules, so that a recipe written per role
applies to any family whatever it names its layers.

Families name the same parts differently: attention is `self_attn.q_proj` in Llama, one fused
`self_attn.qkv_proj` in Phi-3, `mixer.q_proj` in Nemotron-H; the output projection is `lm_head`,
`output` or `embed_out`; a router is `mlp.gate` or `mixer.gate`. A recipe states a rule for a role
with a placeholder in Model Optimizer's `quantizer_name` (`'<attention>*'`, `'<lm_head>*weight_quantizer'`);
`expand_roles` replaces each such rule by one rule per pattern of the modules holding that role in
the model at hand (`ROLES`), before `mtq.quantize` reads the config. The recipe file stays a valid
Model Optimizer recipe (a placeholder rule matches nothing until expanded).

A role is decided by where a projection sits, not by its name: the model's output embeddings are
`lm_head`; a projection inside a module whose class is an attention block is `attention`, inside a
Mamba mixer `mamba`; the gate of a block that holds `experts` (or a router class) is `router`; the
experts themselves (a fused experts module, or the projections under one) are `experts`; every other
projection of a decoder layer is `mlp`. Embeddings are never projections here (recipes leave them BF16).
"""

from __future__ import annotations

import re
from fnmatch import fnmatch

from torch import nn

ROLES = ("attention", "mlp", "experts", "router", "mamba", "lm_head")
PLACEHOLDER = re.compile(r"<(\w+)>")


def is_experts(module: nn.Module) -> bool:
    """A module holding every expert's weights (transformers >= 5 fuses them into 3-D parameters)
    or the expert MLPs (older transformers, remote code)."""
    return fused_experts(module) or type(module).__name__.endswith("Experts")


def fused_experts(module: nn.Module) -> bool:
    """Every expert's projections in 3-D parameters (a convolution's 3-D kernel is not)."""
    return not isinstance(module, nn.modules.conv._ConvNd) and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


def _role_of(ancestors: list[nn.Module], module: nn.Module) -> str:
    """The role of projection `module`, from its ancestors (the model first, its parent last)."""
    parent = ancestors[-1]
    if "router" in type(module).__name__.lower() or (getattr(parent, "gate", None) is module
                                                       and hasattr(parent, "experts")):
        return "router"
    for above in reversed(ancestors):
        kind = type(above).__name__.lower()
        if "mamba" in kind:
            return "mamba"
        if "attention" in kind and "linear" not in kind:
            return "attention"
        if is_experts(above):
            return "experts"
    return "mlp"


def module_roles(model: nn.Module) -> dict[str, str]:
    """{module name: role} for every projection of `model` (its linear layers, routers and fused experts)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    roles: dict[str, str] = {}

    def walk(prefix: str, ancestors: list[nn.Module]) -> None:
        for name, child in ancestors[-1].named_children():
            full = f"{prefix}.{name}" if prefix else name
            if child is head:
                roles[full] = "lm_head"
            elif fused_experts(child):
                roles[full] = "experts"
            elif isinstance(child, nn.Linear) or "router" in type(child).__name__.lower():
                roles[full] = _role_of(ancestors, child)
            else:
                walk(full, [*ancestors, child])
    walk("", [model])
    return roles


def role_patterns(roles: dict[str, str]) -> dict[str, list[str]]:
    """{role: name patterns}: each module's name with its layer and expert indices as `*`
    (`model.layers.*.self_attn.q_proj`), where that pattern matches no module of another role;
    otherwise the module's own name. Each distinct pattern is checked once against the modules (a
    model with per-expert linear layers has tens of thousands of names and a few dozen patterns)."""
    general = {name: re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in roles}
    clashes = {(g, role): any(other != role and (fnmatch(n, g) or fnmatch(n, g + ".*")) for n, other in roles.items())
               for g, role in {(general[name], role) for name, role in roles.items()}}
    patterns: dict[str, list[str]] = {role: [] for role in ROLES}
    for name, role in roles.items():
        pattern = name if clashes[general[name], role] else general[name]
        if pattern not in patterns[role]:
            patterns[role].append(pattern)
    return patterns


def unknown_roles(quant_cfg: list[dict]) -> list[str]:
    """The `<name>` placeholders of `quant_cfg` that are not roles (checked before any model loads)."""
    names = [rule.get("quantizer_name") for rule in quant_cfg if isinstance(rule, dict)]
    return sorted({m for n in names if isinstance(n, str) for m in PLACEHOLDER.findall(n) if m not in ROLES})


def expand_names(patterns: list[str], model: nn.Module) -> list[str]:
    """Module-name patterns (AutoQuantize's `disabled_layers`) with each `<role>` resolved as in `expand_roles`."""
    return [rule["quantizer_name"] for rule in expand_roles([{"quantizer_name": p} for p in patterns], model)]


def expand_roles(quant_cfg: list[dict], model: nn.Module) -> list[dict]:
    """`quant_cfg` with each rule whose `quantizer_name` holds a `<role>` placeholder replaced by one
    rule per pattern of that role's modules in `model` (none where the model has no such module: a
    model without Mamba layers drops the Mamba rules). An unknown role is a ValueError."""
    patterns = role_patterns(module_roles(model))
    out = []
    for rule in quant_cfg:
        name = rule.get("quantizer_name") if isinstance(rule, dict) else None
        found = PLACEHOLDER.search(name) if isinstance(name, str) else None
        if found is None:
            out.append(rule)
            continue
        role = found.group(1)
        if role not in ROLES:
            raise ValueError(f"quantizer_name {name!r}: <{role}> is not a role; roles are {', '.join(ROLES)}")
        out += [{**rule, "quantizer_name": name.replace(found.group(0), pattern)} for pattern in patterns[role]]
    return out
