"""What the local CPU workers' forkserver imports before it forks them (``local_cluster.start_forkserver``).

multiprocessing's preload takes module names, so the imports are this module's body:
the worker code, tiny-bert's modeling code (transformers imports model classes lazily,
~2 s per process) and datasets (the clients' shards), with the cyclic collector off and
then frozen (tasks/collector.py), so every forked worker inherits them outside its
collections.
"""

from __future__ import annotations

from tasks.collector import imports_frozen

with imports_frozen():
    import datasets  # noqa: F401
    import distributed  # noqa: F401
    import transformers.models.bert.modeling_bert  # noqa: F401

    import tasks.worker  # noqa: F401
