"""The files of a run folder that more than one layer reads (names only, no I/O).

``<run>/config.yaml`` the resolved config, ``<run>/data.json`` where its prepared data
lie, ``<run>/timeline/`` first-occurrence marks of start-up events, ``<run>/state/``
the state store, ``<run>/backbone.safetensors`` the frozen backbone of a LoRA run warm-started
from a full fine-tuning run (``model.init_from``; bhfl_core/store/warm_start.py). ``run.json``
(the run record) belongs to flows/records.
"""

CONFIG_FILE = "config.yaml"
DATA_POINTER = "data.json"
TIMELINE_DIR = "timeline"
STATE_DIR = "state"
BACKBONE_FILE = "backbone.safetensors"
