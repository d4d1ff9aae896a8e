"""Local services a run owns: its Prefect API server and the SQLite store templates."""
