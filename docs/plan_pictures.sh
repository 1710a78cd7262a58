#!/usr/bin/env bash
# The plan pictures of docs/img (README, "realloc plan --svg"): each SVG is written by
# `realloc plan ... --svg FILE`, then rendered to PNG by headless Chromium at the SVG's own size.
# Run from the repository root: bash docs/plan_pictures.sh (REALLOC overrides the command;
# CHROMIUM the browser). Pure: no Ray.
set -euo pipefail
REALLOC=${REALLOC:-python -m realloc_tools.offline.plan}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
mkdir -p docs/img

png() {  # png FILE.svg: FILE.png beside it
    local svg size profile
    svg=$(realpath "$1")
    size=$(python3 -c 'import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); print(r.get("width") + "," + r.get("height"))' "$svg")
    profile=$(mktemp -d)
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
        --user-data-dir="$profile" --window-size="$size" --screenshot="${svg%.svg}.png" "file://$svg" 2>/dev/null
    rm -rf "$profile"
}

$REALLOC plan --model llama-70b --src dp=2,tp=4,pp=2 --dst dp=8,tp=2 --gpus-per-node 8 --svg docs/img/plan-2-nodes.svg
png docs/img/plan-2-nodes.svg
$REALLOC plan --model llama-70b --src tp=8,pp=4 --dst dp=4,tp=8 --gpus-per-node 8 --svg docs/img/plan-4-nodes.svg
png docs/img/plan-4-nodes.svg
$REALLOC plan --model llama-70b --src fsdp=2048 --dst dp=256,tp=8 --gpus-per-node 8 --svg docs/img/plan-256-nodes.svg
png docs/img/plan-256-nodes.svg
