#!/usr/bin/env bash
# Render README.md's architecture picture from its text source (needs graphviz: apt-get install graphviz).
set -euo pipefail
cd "$(dirname "$0")/.."
dot -Tsvg docs/img/architecture.dot -o docs/img/architecture.svg
echo "wrote docs/img/architecture.svg"
