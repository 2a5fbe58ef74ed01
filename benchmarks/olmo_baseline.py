"""The unsharder users have today, run the way its own script runs it: OLMo's
`TorchLegacyShardedCheckpointer.unshard_checkpoint`, then `torch.save` of model.pt, optim.pt, train.pt.

    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 python benchmarks/olmo_baseline.py SRC OUT [--shared-mem]

Needs PyPI's ai2-olmo (installed with --no-deps by the harness, plus the few small packages it imports).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--shared-mem", action="store_true", help="its process + shared-memory mode (fp32 only)")
    args = ap.parse_args()
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch
    from olmo.checkpoint import TorchLegacyShardedCheckpointer
    from olmo.config import TrainConfig

    checkpointer = TorchLegacyShardedCheckpointer(TrainConfig(), use_shared_mem_impl=args.shared_mem)
    model, optim, train = checkpointer.unshard_checkpoint(args.src)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model, out / "model.pt")
    torch.save(optim, out / "optim.pt")
    torch.save(train, out / "train.pt")


if __name__ == "__main__":
    main()
