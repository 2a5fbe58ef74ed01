"""A checkpoint of no trainer recognised: torch DCP's own nesting as saved (what dcp_to_torch_save
writes), or a state dict of a script's own nesting. Its model is where a script most often puts it."""

from __future__ import annotations

from .contract import Trainer, one_file

MODEL = ("model", "state/model", "state_dict")

# any script's save of a folder of its own (`dcp.save`: per-rank files share folders)
DCP = Trainer("dcp", "dcp (torch DCP's own nesting, as saved)", MODEL,
              lambda tree, reader: reader is not None and reader.any_script and not reader.shares_folder, one_file)
GENERIC = Trainer("generic", "generic (a state dict of the trainer's own nesting)", MODEL,
                  lambda tree, reader: True, one_file)
