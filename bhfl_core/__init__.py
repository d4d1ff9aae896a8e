"""Pure B-HFL algorithms: tree, node optimisers, EXECUTENODE, state store, TRAIN/EVAL loops.

Nothing in this package imports prefect or mlflow (a test guards it), so it can be
used as a plain library and unit-tested without starting any server.
"""
