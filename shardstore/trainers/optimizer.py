"""An optimizer's state dict keyed by parameter number, as `torch.optim.Optimizer.state_dict()` keys it.

FSDP saves an optimizer's state keyed by parameter name, its param_groups listing the names; the number of
a parameter is its place in those lists, group after group, as `Optimizer.state_dict()` numbers them.
The HF Trainer, Accelerate and Lightning resume through `Optimizer.load_state_dict`, which needs numbers.
"""

from __future__ import annotations

from typing import Any

from ..errors import ExportError


def by_parameter_number(optimizer: Any) -> dict[str, Any]:
    """An optimizer's state dict keyed by parameter name (FSDP's) keyed as `Optimizer.state_dict()` keys
    it, which `Optimizer.load_state_dict` needs."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise ExportError("the optimizer's state has no param_groups listing its parameters; export it with "
                          "--format dcp, or as saved with --format safetensors --select")
    names = [name for group in groups for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    if len(number) != len(names):
        raise ExportError(f"the optimizer's param_groups list a parameter twice "
                          f"({next(n for n in names if names.count(n) > 1)!r:.80})")
    state = optimizer.get("state", {})
    unlisted = next((name for name in state if name not in number), None)
    if unlisted is not None:
        raise ExportError(f"the optimizer's state of {unlisted!r:.80}: no param_group lists it")
    return {"state": {number[name]: state[name] for name in sorted(state, key=number.__getitem__)},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [number[n] for n in g["params"]]}
                             for g in groups]}
