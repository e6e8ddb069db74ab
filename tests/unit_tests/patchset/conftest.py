"""Re-export the fake-project fixture (helpers live in patchset_fake.py so tests can import them)."""

from patchset_fake import fake, overlaid  # noqa: F401
