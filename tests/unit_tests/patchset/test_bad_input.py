"""Bad input a new user meets, refused with a sentence that is right about the cause and the way out.

Driven through the command line (``hfsdp.patchset.cli.main``); the probe table
(test_probe_table.py) runs the same inputs as a user would, through ``scripts/patchset``.
"""

from __future__ import annotations

from patchset_fake import Env

from hfsdp.patchset.cli import main
from hfsdp.patchset.series import crlf_line


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def test_crlf_line_counts_the_patch_syntax_not_the_content_of_a_crlf_file() -> None:
    of_a_crlf_file = ("diff --git a/megatron/core/w.py b/megatron/core/w.py\n--- a/megatron/core/w.py\n"
                      "+++ b/megatron/core/w.py\n@@ -1,2 +1,2 @@ def f():\r\n def f():\r\n-    return 1\r\n"
                      "+    return 2\r\n")
    assert crlf_line(of_a_crlf_file) is None
    assert crlf_line(of_a_crlf_file.replace("+++ b/megatron/core/w.py\n", "+++ b/megatron/core/w.py\r\n")) == 3
    assert crlf_line("@@ -1 +1 @@\r\n") == 1
    assert crlf_line("Description: x\r\n---\n", header_lines=1) == 1
