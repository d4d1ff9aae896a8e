"""After training: the evaluation matrix, proximity analysis, communication accounting, seeds, comparison tables."""
