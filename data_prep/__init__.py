"""Data preparation: sources, language-clustered partitions, tokenisation, on-disk cache."""
