#!/usr/bin/env bash
# Install headless Chromium from the distribution's packages, for the test that opens the HTML
# report in a real browser (tests/test_report_view.py). Fails loudly: no browser, no green CI.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    chromium --version
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
chromium --version  # fails the script if the package did not give a working browser
