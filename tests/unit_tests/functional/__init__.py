"""Tests of the functional driver. A package: its test modules are imported as functional.<name>, so
their basenames may repeat those of other test folders (test_probe_table.py)."""
