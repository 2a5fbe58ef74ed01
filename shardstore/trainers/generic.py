"""A checkpoint of no trainer recognised: torch DCP's own nesting as saved (what dcp_to_torch_save
writes), or a state dict of a script's own nesting. Its model is where a script most often puts it."""

from __future__ import annotations

from .contract import Trainer, one_file

MODEL = ("model", "state/model", "state_dict")

DCP = Trainer("dcp", "dcp (torch DCP's own nesting, as saved)", MODEL, lambda tree, format: format == "dcp", one_file)
GENERIC = Trainer("generic", "generic (a state dict of the trainer's own nesting)", MODEL,
                  lambda tree, format: True, one_file)
