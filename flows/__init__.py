"""Prefect flows, MLflow tracking and the ``bhfl`` CLI."""
