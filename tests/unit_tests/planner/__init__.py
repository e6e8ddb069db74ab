"""The memory planner's tests, a package: its test_probe_table.py shares a basename with the benchmark's."""
