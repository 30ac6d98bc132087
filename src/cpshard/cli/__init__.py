"""The ``cpshard`` command: argument parsing, runners and reports of each sub-command.

The work itself lives in :mod:`cpshard.tools` and the core; the cli may import any of them.
Nothing else imports the cli (only :mod:`cpshard.__main__`, to run it).
"""
