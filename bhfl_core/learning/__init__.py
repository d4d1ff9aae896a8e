"""TRAIN and EVAL: models, tasks (classification, MLM), local training loops, metrics, flat parameter vectors."""
