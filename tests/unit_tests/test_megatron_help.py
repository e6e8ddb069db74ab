"""Megatron's ``--help`` renders on every base: argparse %-formats help strings, and the help that
Megatron generates from config docstrings ("10%") is escaped (the arguments-help-percent patch)."""

import argparse


def test_megatron_help_renders_the_flags_generated_from_docstrings() -> None:
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    text = parser.format_help()  # raised "unsupported format character" without the patch
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "10%" in text
