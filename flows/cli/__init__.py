"""The ``bhfl`` command line application and its user-facing messages."""
