#!/usr/bin/env bash
# Headless Chromium from Debian's packages, for the test that opens the HTML report in a real
# browser (tests/test_report_view.py). Where it can't be installed the script fails with one line
# saying why: the test needs a real browser, and a missing one fails it (never a silent skip).
set -uo pipefail
if command -v chromium >/dev/null 2>&1; then
    echo "chromium: $(chromium --version 2>/dev/null)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ERROR: Chromium is not installed and cannot be (needs root or sudo): install Debian's chromium package" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null; then
    echo "ERROR: Chromium is not installed and cannot be (no apt-get): install Debian's chromium package" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core >/dev/null && chromium --version >/dev/null 2>&1
then
    echo "chromium: $(chromium --version 2>/dev/null)"
else
    echo "ERROR: apt-get install chromium failed (or the browser does not start); the HTML report test needs it" >&2
    exit 1
fi
