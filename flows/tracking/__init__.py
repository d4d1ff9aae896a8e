"""MLflow tracking and the reports (metrics, tables, figures) logged to it."""
