"""Thin Prefect tasks around bhfl_core / data_prep calls. No algorithm logic here."""
