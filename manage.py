#!/usr/bin/env python
"""Django's command-line utility for the portal (web side)."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    from portal.config import load_config_or_exit

    # Validate before Django imports settings, so a bad value is one line, not a traceback.
    load_config_or_exit(os.environ)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
