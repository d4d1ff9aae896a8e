"""The experiment config: schema, loading with overrides, and building the tree from config + manifest."""
