#!/usr/bin/env bash
# Vendor the web console's npm libraries (xterm.js, its fit addon, uPlot) into
# src/sandfleet/console/static/vendor/, from the exact versions src/sandfleet/console/package-lock.json
# pins: `npm ci` in a temp dir (no install scripts), then only the files the console loads, with their
# licenses. The page loads nothing from a CDN. Idempotent: skipped when the files are there and the
# stamp says they came from this lock. Needs npm and the npm registry.
set -euo pipefail
cd "$(dirname "$0")/.."
CONSOLE=src/sandfleet/console
VENDOR=$CONSOLE/static/vendor
# <path in node_modules> <name in vendor/>
FILES=(
    "@xterm/xterm/lib/xterm.js xterm.js"
    "@xterm/xterm/css/xterm.css xterm.css"
    "@xterm/xterm/LICENSE LICENSE.xterm"
    "@xterm/addon-fit/lib/addon-fit.js addon-fit.js"
    "@xterm/addon-fit/LICENSE LICENSE.addon-fit"
    "uplot/dist/uPlot.iife.min.js uPlot.iife.min.js"
    "uplot/dist/uPlot.min.css uPlot.min.css"
    "uplot/LICENSE LICENSE.uplot"
)

stamp=$(cat "$CONSOLE/package.json" "$CONSOLE/package-lock.json" | sha256sum | cut -d' ' -f1)
have_all() {
    local f
    for f in "${FILES[@]}"; do
        [ -f "$VENDOR/${f#* }" ] || return 1
    done
}
if [ -f "$VENDOR/.stamp" ] && [ "$(cat "$VENDOR/.stamp")" = "$stamp" ] && have_all; then
    exit 0
fi

command -v npm >/dev/null || { echo "vendor_console.sh: npm is missing (apt-get install npm)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$CONSOLE/package.json" "$CONSOLE/package-lock.json" "$work/"
(cd "$work" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)

mkdir -p "$work/vendor"
for f in "${FILES[@]}"; do
    cp "$work/node_modules/${f% *}" "$work/vendor/${f#* }"
done
# The source-map comments point at maps that are not vendored: drop them (no 404 in the dev tools).
sed -i '/^\/\/# sourceMappingURL=/d' "$work/vendor/xterm.js" "$work/vendor/addon-fit.js"
echo "$stamp" >"$work/vendor/.stamp"
rm -rf "$VENDOR.tmp"
mv "$work/vendor" "$VENDOR.tmp"
rm -rf "$VENDOR"
mv "$VENDOR.tmp" "$VENDOR"
echo "vendored the console's libraries into $VENDOR"
