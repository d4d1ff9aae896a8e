"""Run folders: run.json records, listing runs and what a resume would redo."""
