#!/usr/bin/env bash
# Installs what the browser tests (tests/browser/) need when it is missing:
# Debian's chromium at /usr/bin/chromium (Playwright's own browser download cannot work here)
# and the playwright Python package in the virtualenv. Idempotent; safe to run on every `make test`.
#   usage: bash deploy/local/ensure-browser.sh [path/to/venv]
set -euo pipefail
VENV="${1:-.venv}"
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  echo "ensure-browser: installing Debian's chromium" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
if ! "$VENV/bin/python" -c "import playwright" 2>/dev/null; then
  echo "ensure-browser: installing playwright into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet "playwright>=1.49,<2"
fi
/usr/bin/chromium --version >&2
