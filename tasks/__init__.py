"""Prefect tasks: thin adapters over ragen_core (STYLE.md rule 6): call one function, return.

Tasks exist where Prefect's visibility helps (each step shows in the UI with its timing);
none retries, because every step changes the run's state (weights, counters).
"""
